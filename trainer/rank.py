"""A trainer rank other than 0: ``python -m trainer.rank --rank R --world W ...``.

It joins the trainer's group, receives the run's config from rank 0, builds the same model
(its shard of it) and optimizer, and runs what rank 0 tells until rank 0 says stop
(:meth:`trainer.learner.Learner.follow`). It never touches Redis. :func:`run_node` is
``rlbus trainer`` on a node other than rank 0's (``trainer.node_rank`` > 0): it starts that
node's ranks and waits for them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main", "run_node"]


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer.rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one follower rank; its exit code (1 naming the failure on stderr)."""
    args = _args(argv)
    prog = f"trainer rank {args.rank}"
    import msgspec
    import torch

    from policy import resolve_device
    from profiling import create_agent, prepare_main_thread
    from runconfig import Config
    from trainer.learner import Learner, make_optimizer
    from trainer.ranks import RankFailed, RankGroup, RankSpec, collective_failure

    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", args.local_rank)
    spec = RankSpec(args.rank, args.world, args.local_rank, args.addr, args.port)
    group = RankGroup(spec, device, args.timeout)
    try:
        group.open()
        op, payload = group.receive()
        if op != "config":
            raise RankFailed(f"rank 0 sent {op!r} before the run's config")
        tree, after_step = payload
        cfg = msgspec.convert(tree, type=Config)
        learner = Learner(cfg, group)
        prepare_main_thread(cfg, str(device))
        learner.build()
        learner.optimizer, learner.scheduler = make_optimizer(learner.policy.parameters(),
                                                              cfg.trainer)
        # Its own traces, at the steps rank 0 relays (trainer.rankprofile).
        learner.agent = create_agent(cfg, "trainer", args.rank, str(device),
                                     after_step=after_step)
        learner.follow()
        if learner.agent is not None:  # its traces written (idempotent after rank 0's close)
            learner.agent.close()
        return 0
    except RankFailed as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:
        # A collective that failed mid-operation: rank 0 or another rank went away (rank 0
        # names the run's failure); one line, not the backend's traceback.
        lost = collective_failure(exc)
        if lost is None:
            raise
        print(f"{prog}: error: a collective with the other trainer ranks failed, rank 0 or "
              f"another rank is gone or unreachable ({type(exc).__name__}: {lost})",
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        group.close()


def run_node(cfg: object) -> int:
    """``rlbus trainer`` with ``trainer.node_rank`` > 0: this node's ranks, started and
    waited for (they end when rank 0 says stop, or fail with it)."""
    from runconfig import Config
    from trainer.ranks import spawn_ranks, world_size

    assert isinstance(cfg, Config)
    tc = cfg.trainer
    if tc.master_port is None:  # the config check refuses this; one line if it did not
        print("trainer: error: trainer.master_port is needed on every node", file=sys.stderr)
        return 2
    first = tc.node_rank * tc.n_gpus_per_node
    procs = spawn_ranks(range(first, first + tc.n_gpus_per_node), tc.n_gpus_per_node,
                        world_size(tc), tc.master_addr, tc.master_port,
                        device=tc.device, timeout_s=tc.dist_timeout_s)
    print(f"trainer: node {tc.node_rank}: ranks {first}..{first + len(procs) - 1} joining "
          f"{tc.master_addr}:{tc.master_port}", file=sys.stderr, flush=True)

    def stop(signum: int, _frame: object) -> None:
        for p in procs:
            p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    codes = [p.wait() for p in procs]
    return max((c if c >= 0 else 1) for c in codes)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown. The group is closed and every file written
    by then; what is left is torch's C++ state (the sharded model still refers to the closed
    group), whose destructors at exit now and then abort the process with ``terminate called
    without an active exception`` (3 of 44 resumes of the resume test here), turning a clean
    exit into SIGABRT."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
