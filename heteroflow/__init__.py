"""heteroflow: train one Transformer across a cluster that mixes accelerator vendors.

Importing the package is cheap: no torch, deepspeed or torch_npu are imported here.
"""

__version__ = "0.1.0"
