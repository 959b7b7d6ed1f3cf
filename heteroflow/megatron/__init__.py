"""Import Megatron-LM launch scripts, `--yaml-cfg` files and NeMo model YAML as heteroflow jobs.

`import_megatron(path, ImportOptions(...))` reads the source without running anything (see `shell/`),
maps every argument with Megatron's defaults and rules, and returns an `ImportResult`: the job (with an
explicit plan equal to the Megatron layout), the `MegatronLayout`, and the per-argument `ImportReport`.
`export_megatron(job)` goes the other way, for jobs whose plan Megatron can express.
"""

from heteroflow.megatron.context import MegatronRuleError
from heteroflow.megatron.export import MegatronCommand, export_megatron
from heteroflow.megatron.importer import ImportOptions, ImportResult, dump_job_yaml, import_megatron
from heteroflow.megatron.layout import MegatronLayout
from heteroflow.megatron.report import Entry, ImportReport

__all__ = ["Entry", "ImportOptions", "ImportReport", "ImportResult", "MegatronCommand", "MegatronLayout",
           "MegatronRuleError", "dump_job_yaml", "export_megatron", "import_megatron"]
