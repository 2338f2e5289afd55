"""The cluster secret: where each side gets it, and the link keys it gives.

    node 0     config's multinode.cluster_secret ─▶ else SHARDSERVE_CLUSTER_SECRET ─▶ else a new
               one, printed in the command that starts each other node
    node R     config's multinode.cluster_secret ─▶ else SHARDSERVE_CLUSTER_SECRET ─▶ refused

It travels explicitly: `with_cluster_secret` fills the config's field before the engine cores
start (so every replica's link has the one secret that was printed), and the link's two sides
take it as an argument. Nothing writes it into os.environ: the MessageQueues' TCP paths need no
shared secret, since their keys travel in their handles (ipc/curve_auth.py; a secret the user
set in the environment still keys them, as before).
"""

from __future__ import annotations

import secrets
import shlex
import sys
from dataclasses import replace

from shardserve import envs
from shardserve.config import EngineConfig, ParallelConfig
from shardserve.ipc.curve_auth import CurveKeys


def link_keys(secret: str) -> CurveKeys:
    """The link's CURVE keys (both sides derive the same ones from the same secret)."""
    return CurveKeys.from_secret(secret.encode())


def cluster_secret(config: EngineConfig) -> str:
    """Node 0's secret: the config's, else SHARDSERVE_CLUSTER_SECRET, else a new one (printing
    how to start the other nodes with it)."""
    given = config.parallel_config.multinode.cluster_secret or envs.cluster_secret()
    if given is not None:
        return given
    secret = secrets.token_hex(16)
    _print_headless_commands(config, secret)
    return secret


def with_cluster_secret(config: EngineConfig) -> EngineConfig:
    """`config` carrying node 0's secret (resolved once here, so that the engine cores started
    from it share the secret and the commands are printed once); as is for one node."""
    pc = config.parallel_config
    if pc.multinode.nnodes < 2 or pc.multinode.cluster_secret is not None:
        return config
    multinode = replace(pc.multinode, cluster_secret=cluster_secret(config))
    return replace(config, parallel_config=replace(pc, multinode=multinode))


def headless_secret(pc: ParallelConfig) -> str:
    """A headless node's secret, which node 0 printed (or the user chose for every node)."""
    secret = pc.multinode.cluster_secret or envs.cluster_secret()
    if secret is None:
        raise ValueError("SHARDSERVE_CLUSTER_SECRET is not set: every node must hold the secret "
                         "node 0 printed when it started (or one you chose for all of them)")
    return secret


def _print_headless_commands(config: EngineConfig, secret: str) -> None:
    pc = config.parallel_config
    model = config.model_config.model or str(config.model_config.path)
    for rank in range(1, pc.multinode.nnodes):
        command = (f"SHARDSERVE_CLUSTER_SECRET={secret} shardserve serve {shlex.quote(model)} "
                   f"--headless --nnodes {pc.multinode.nnodes} --node-rank {rank} "
                   f"--master-addr {pc.multinode.master_addr} "
                   f"--master-port {pc.multinode.master_port} "
                   f"--tensor-parallel-size {pc.tensor_parallel_size} "
                   f"--pipeline-parallel-size {pc.pipeline_parallel_size}"
                   f"{f' -pcp {pcp}' if (pcp := pc.prefill_context_parallel_size) > 1 else ''}"
                   f"{f' -dcp {dcp}' if (dcp := pc.decode_context_parallel_size) > 1 else ''}"
                   f"{f' --data-parallel-size {dp}' if (dp := pc.data_parallel_size) > 1 else ''}")
        print(f"shardserve: start node {rank} with:\n  {command}", file=sys.stderr, flush=True)
