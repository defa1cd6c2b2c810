"""Graph models (MTPP partitioning, Nesa sec. 2.5): plans naming which stage of a traced model each node serves,
the stage node (`stage`), its client pipeline (`pipeline`), example models (`models`) and the `run` options (`cli`).

The stage node never imports the client side (client, pipeline), and the pipeline never imports the server side.
"""
