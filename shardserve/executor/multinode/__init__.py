"""Multi-node mp: node 0 runs the engine and its own ranks; every other node runs only workers
(`shardserve serve --headless`), linked to node 0 by one authenticated ZMQ connection per
replica.

    messages.py      the wire messages, their frames, the heartbeat timing (the exchange)
    remote_nodes.py  node 0's side: RemoteNodes (gather, start, watch the headless nodes)
    headless.py      the headless side: run_headless, HeadlessNode
    secret.py        the cluster secret (given or made at node 0) and the link keys
    sockets.py       the link's port per replica, the headless DEALER, send / receive
"""
