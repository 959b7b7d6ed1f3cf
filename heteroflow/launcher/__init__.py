"""The launcher side of `heteroflow train`: everything that runs before, around and after the workers.

`prepare` (options, plan, the checks before any worker starts), `train` (the entry point: one machine
or this node's share), `launch` (one worker process per device through torch elastic), `multinode` and
`rendezvous` (node agents meeting, replanning after a lost node), `placement` (which plan ranks run on
which node, and their environment), `swap` (room for offload swap files; sweeping what killed ranks left).

The workers' side is `heteroflow.runtime`; it never imports this package.
"""
