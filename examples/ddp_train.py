"""DDP training on a shared worker fleet, checkpointed mid-epoch and resumed exactly.

    torchrun --nproc_per_node=2 examples/ddp_train.py           # 2 epochs, "preempted" mid-epoch 2
    torchrun --nproc_per_node=2 examples/ddp_train.py --quick   # small, checks itself (the test runs it)
    torchrun --nproc_per_node=2 examples/ddp_train.py --resume  # continue from the saved checkpoint

A linear regression on synthetic data, trained with DistributedDataParallel (gloo, CPU).
Every item is generated on a worker from its index; the workers shuffle, shard and batch.

**The fleet.** A real job runs ``rpc-reading-worker --host 0.0.0.0 --port 29600`` on its CPU
hosts and passes their addresses: ``--workers cpu1:29600,cpu2:29600 --auth-key-file key``.
Without ``--workers``, rank 0 starts ``--fleet-size`` worker servers on this host as a stand-in
for those hosts and sends their addresses and a fresh key to the other ranks. Every rank then
opens ``--sessions`` sessions on the *same* servers: one fleet, sized for the whole job and
independent of the trainers, which is what a real deployment looks like (copy this part and
replace ``start_local_fleet`` by your hosts). Letting each rank start private local workers
(``RPCReadingService(num_workers=N)``) also works, but then nothing is shared.

**The reading service.** ``SequentialReadingService(DistributedReadingService(), RPCReadingService(...))``:
rank ``r``'s session ``i`` reads global shard ``r * sessions + i``, one shuffle seed is shared
by the job, and fullsync keeps the number of batches equal on every rank (DDP needs that).

**Checkpoints.** ``dl.state_dict()`` is per rank and small (the epoch's seed and how many
items of each shard this rank consumed; no data). Each rank saves it with the model and
optimizer state to ``CKPT_DIR/rank{R}.pt``. ``DataLoader2.from_state(state, reading_service)``
continues the epoch: each worker replays its shard from the same seed and skips what was
consumed (compute proportional to the position, nothing stored), so the rest of the epoch,
and every later epoch, is exactly what the uninterrupted run would have seen. Resume with the
same world size, ``--sessions`` and pipeline; another one is refused with a ConfigurationError.
"""

import argparse
import os
import secrets
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=r"(?s).*'datapipes', 'dataloader2' modules are deprecated")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message=r".*DistributedReadingService.* doesn't support")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from rpc_reading_service import RPCReadingService  # noqa: E402

FEATURES = 8
TRUE_W = torch.linspace(-1.0, 1.0, FEATURES)
TRUE_B = 0.5


def make_example(index):
    """One synthetic example, generated on a worker from its index (the "decode" step)."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(FEATURES, generator=g)
    y = x @ TRUE_W + TRUE_B + 0.01 * torch.randn((), generator=g)
    return index, x, y


def build_datapipe(items, batch_size):
    # Randomness before sharding_filter uses the job's shared seed: every rank agrees on the shuffle.
    return (
        IterableWrapper(range(items))
        .shuffle()
        .sharding_filter()
        .map(make_example)
        .batch(batch_size)
        .collate()
    )


def make_reading_service(fleet, sessions):
    addresses, key = fleet
    return SequentialReadingService(
        DistributedReadingService(),  # distributed sharding, shared seed, fullsync
        RPCReadingService(workers=addresses, auth_key=key, num_workers=sessions),
    )


# -- the fleet ------------------------------------------------------------------------------------
def start_local_fleet(size):
    """Start ``size`` worker servers here (stand-ins for CPU hosts); return (procs, addresses, key)."""
    key = secrets.token_hex(16)
    env = dict(os.environ, RPC_READING_SERVICE_AUTH_KEY=key)  # the key goes by environment, not argv
    command = [
        sys.executable, "-m", "rpc_reading_service.worker", "--host", "127.0.0.1", "--port", "0",
        "--log-level", "WARNING", "--parent-pid", str(os.getpid()),  # exit if this rank dies
    ]  # fmt: skip
    procs = [
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
        for _ in range(size)
    ]
    addresses = []
    for proc in procs:
        line = proc.stdout.readline().decode().strip()  # "listening on HOST:PORT" once ready
        if not line.startswith("listening on "):
            for p in procs:
                p.kill()
            raise RuntimeError(f"worker server did not start (printed {line!r})")
        addresses.append(line[len("listening on ") :])
    return procs, addresses, key


def shared_fleet(args, rank):
    """(addresses, key) of the fleet every rank uses, plus the local servers rank 0 must stop."""
    if args.workers:
        key = (
            open(args.auth_key_file).read().strip()
            if args.auth_key_file
            else os.environ["RPC_READING_SERVICE_AUTH_KEY"]
        )
        return (args.workers.split(","), key), []
    procs, message = [], [None]
    if rank == 0:
        procs, addresses, key = start_local_fleet(args.fleet_size)
        message = [(addresses, key)]
        print(f"rank 0 started {len(addresses)} worker servers: {', '.join(addresses)}", flush=True)
    dist.broadcast_object_list(message, src=0)  # the other ranks learn the addresses and key
    return message[0], procs


# -- training -------------------------------------------------------------------------------------
def train(args, fleet, state=None, stop_at_step=None):
    """Train until ``args.epochs`` are done, starting from checkpoint ``state`` if given.

    With ``stop_at_step``, stop after that global step and return a checkpoint instead.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(FEATURES, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    reading_service = make_reading_service(fleet, args.sessions)
    if state is None:
        dl = DataLoader2(build_datapipe(args.items, args.batch_size), reading_service=reading_service)
        dl.seed(args.seed)
        epoch, step = 0, 0
        # Which items each epoch delivered here: only for the demo's exactly-once check at the end.
        seen = torch.zeros(args.epochs, args.items, dtype=torch.int64)
    else:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        dl = DataLoader2.from_state(state["dataloader"], reading_service)  # continues the epoch
        epoch, step, seen = state["epoch"], state["step"], state["seen"]
    try:
        while epoch < args.epochs:
            start, items = time.perf_counter(), 0
            for indices, x, y in dl:
                loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen[epoch, indices] += 1
                step, items = step + 1, items + len(indices)
                if rank == 0 and step % args.log_every == 0:
                    rate = items / (time.perf_counter() - start)
                    print(
                        f"epoch {epoch} step {step}: loss {loss.item():.5f} ({rate:.0f} items/s on rank 0)",
                        flush=True,
                    )
                if step == stop_at_step:
                    checkpoint = {
                        "dataloader": dl.state_dict(),
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                        "step": step,
                        "seen": seen,
                    }
                    return checkpoint
            epoch += 1
    finally:
        dl.shutdown()
    return {"model": model.module.state_dict(), "step": step, "seen": seen}


def check_exactly_once(seen, rank):
    """Every item of every epoch reached exactly one rank, exactly once (checked on rank 0)."""
    total = seen.clone()
    dist.all_reduce(total)
    ok = bool((total == 1).all())
    if rank == 0:
        print(
            f"every item of every epoch seen exactly once across {dist.get_world_size()} ranks: {ok}",
            flush=True,
        )
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", help="host:port,... of running rpc-reading-worker servers (default: start a local fleet)"
    )
    parser.add_argument(
        "--auth-key-file", help="the workers' key (else $RPC_READING_SERVICE_AUTH_KEY), with --workers"
    )
    parser.add_argument(
        "--fleet-size", type=int, default=2, help="local worker servers rank 0 starts (without --workers)"
    )
    parser.add_argument("--sessions", type=int, default=2, help="worker sessions per rank (num_workers)")
    parser.add_argument("--items", type=int, default=16384, help="examples per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    parser.add_argument("--checkpoint-dir", default="ddp_train_checkpoints")
    parser.add_argument(
        "--preempt-at-step",
        type=int,
        default=-1,
        help="save a checkpoint after this global step, drop everything, and resume from the file "
        "(-1: the middle of the last epoch; 0: never)",
    )
    parser.add_argument("--resume", action="store_true", help="start from the checkpoint in --checkpoint-dir")
    parser.add_argument("--verify", action="store_true", help="also train without interruption and compare")
    parser.add_argument("--quick", action="store_true", help="a small run that verifies itself (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.batch_size, args.log_every, args.verify = 512, 16, 4, True

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fleet, fleet_procs = shared_fleet(args, rank)
    steps_per_epoch = args.items // (world * args.batch_size)
    if args.preempt_at_step == -1:
        args.preempt_at_step = (args.epochs - 1) * steps_per_epoch + steps_per_epoch // 2
    path = os.path.join(args.checkpoint_dir, f"rank{rank}.pt")
    ok = True
    try:
        if args.resume:
            state = torch.load(path, weights_only=False)
            print(
                f"rank {rank}: resuming from {path} at epoch {state['epoch']} step {state['step']}",
                flush=True,
            )
            result = train(args, fleet, state)
        elif args.preempt_at_step:
            state = train(args, fleet, stop_at_step=args.preempt_at_step)
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(state, path)
            graph_bytes = len(state["dataloader"]["serialized_datapipe"])
            positions_bytes = len(state["dataloader"]["reading_service_state"])
            print(
                f"rank {rank}: checkpoint at epoch {state['epoch']} step {state['step']} -> {path} "
                f"(DataLoader2 state: the pipeline {graph_bytes} bytes, seeds and positions "
                f"{positions_bytes} bytes); simulating preemption",
                flush=True,
            )
            del state  # everything is gone but the file
            state = torch.load(path, weights_only=False)
            print(f"rank {rank}: resumed from {path}", flush=True)
            result = train(args, fleet, state)
        else:
            result = train(args, fleet)
        ok = check_exactly_once(result["seen"], rank)
        weights = result["model"]["weight"].flatten()
        if rank == 0:
            error, bias = (weights - TRUE_W).abs().max().item(), result["model"]["bias"].item()
            print(
                f"done after {result['step']} steps: max |w - w_true| = {error:.4f}, b = {bias:.4f}",
                flush=True,
            )
        if args.verify:
            reference = train(args, fleet)
            same = all(torch.equal(result["model"][k], reference["model"][k]) for k in reference["model"])
            same = same and torch.equal(result["seen"], reference["seen"])
            if rank == 0:
                print(
                    f"resumed run identical to an uninterrupted run (weights and items): {same}", flush=True
                )
            ok = ok and same
    finally:
        dist.barrier()  # nobody uses the fleet any more
        for proc in fleet_procs:
            proc.terminate()
        for proc in fleet_procs:
            proc.wait(10)
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
