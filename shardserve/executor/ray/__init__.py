"""The Ray backends and what they share. Imported only when a Ray backend is chosen, so
shardserve itself imports without Ray (this file imports nothing).

    cluster.py              connect to (or start) Ray, and undo exactly that
    placement.py            the placement group of the ranks, ordered driver node first
    actor.py                RayWorkerWrapper: the actor hosting one rank's Worker
    worker_group.py         RayWorkerGroup: the actors of one engine, placement to teardown,
                            and their death watch
    compiled_graph.py       one model step as a Ray Compiled Graph (`ray`, when chosen)
    distributed_executor.py RayDistributedExecutor (`ray`): actor calls or the compiled graph
    executor_v2.py          RayExecutorV2 (`ray_v2`): Ray places the workers, the queue RPC of
                            the mp backend (executor/queue_rpc.py) moves the data
"""
