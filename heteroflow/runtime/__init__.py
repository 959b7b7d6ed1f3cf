"""The worker side of `heteroflow train`: what each rank runs once the launcher (`heteroflow.launcher`)
has started it.

`worker` (the per-rank entry point and training loop), `stage` (this rank's model shard, optimizer and
boundaries), `pipeline` (one step's micro-batches in the order of `layout.schedule`'s action lists),
`checkpoint` (saving and resuming), `watchdog` (a rank stuck in one step), `metrics`, `lr`, `nodes` (joining
the world under the plan's rank on a multi-node run), `offload_setup` (a stage's offload settings as
objects), `user_errors` (a worker's user error carried to the launcher), and `reference` (the
single-process trainer the tests compare with). Nothing here imports the launcher.
"""
