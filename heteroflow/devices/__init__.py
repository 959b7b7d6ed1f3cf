"""Devices: the local probe and the one device facade everything else uses, and the device reports.

The chip catalog's data lives in `heteroflow.config.catalog` (a job is validated against it without this
package); it is re-exported here.

Importing this package does not import torch: the probe and the facade import it inside functions, so
planning and config validation work on a machine without torch.
"""

from heteroflow.config.catalog import ALIASES, CATALOG, catalog_names, lookup
from heteroflow.config.device import DeviceSpec
from heteroflow.devices.facade import Device, NullEvent, NullStream, collective_backend, emulated
from heteroflow.devices.probe import LocalDevice, import_torch_npu, match_catalog_name, probe_local_devices
from heteroflow.devices.report import catalog_json, devices_json, format_catalog, format_devices

__all__ = [
    "ALIASES",
    "CATALOG",
    "Device",
    "DeviceSpec",
    "LocalDevice",
    "NullEvent",
    "NullStream",
    "catalog_json",
    "catalog_names",
    "collective_backend",
    "devices_json",
    "emulated",
    "format_catalog",
    "format_devices",
    "import_torch_npu",
    "lookup",
    "match_catalog_name",
    "probe_local_devices",
]
