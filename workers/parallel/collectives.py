"""The process groups of one tensor-parallel replica, and the few collectives kvmesh uses.

Two groups over one TCPStore that rank 0 hosts (`tcp://host:port`, rank 0's node address):
* `ctrl`: gloo on CPU, rank 0 -> all broadcasts of pickled messages (each step's inputs and
  cache commands). Followers wait for the next message while the engine idles, so that one
  wait has no practical timeout; a dead rank 0 still ends it at once (the TCP pair closes).
* `dev`: the model's reductions (gloo on CPU, NCCL on CUDA), bounded by `timeout_s`: a rank
  that died or stalls turns into `RankFailed` within that time, never a hang.
Forming the groups and waiting for every rank to load its shard may take START_TIMEOUT_S
(a rank that dies meanwhile fails it at once). Each rank's gloo pairs listen on the address by
which it reaches rank 0's host (`local_address`), not on its hostname's, so the ranks of a
replica that spans nodes (data_parallel_size_local) connect across hosts; NCCL picks its own
interfaces.

`SingleRank` is the same interface for TP=1 (every collective is the identity), so the model
has one code path. Every collective's wall time is summed in `stats` (the benchmark's
collectives-vs-compute split); on CUDA that needs `sync_timing` (a synchronize per op).
"""
from __future__ import annotations

import datetime
import pickle
import socket
import time

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from kvmesh.workers.errors import RankFailed
from kvmesh.workers.model.shard import SingleRank

IDLE_TIMEOUT = datetime.timedelta(days=30)    # followers wait this long for rank 0's next step
START_TIMEOUT_S = 600.0                         # ranks spawning and loading their shard


class Collectives(SingleRank):
    """Rank `rank` of a `size`-rank replica (see the module docstring)."""

    def __init__(self, rank: int, size: int, init_method: str, device: str, timeout_s: float,
                 store: dist.TCPStore | None = None, name: str = "", control: bool = True):
        """`name`: a prefix for the groups' keys, so that several groups share one store (a
        data-parallel replica's expert group over every rank of its TP groups: "experts/");
        `control`: form the `ctrl` group (a group that only reduces needs none)."""
        super().__init__()
        self.rank, self.size, self.device, self.sync_timing = rank, size, torch.device(device), False
        host, port = parse_init_method(init_method)
        self.init_method = init_method
        self.timeout = timeout = datetime.timedelta(seconds=timeout_s)
        self.start_timeout = start = datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
        try:
            self.store = store or dist.TCPStore(host, port, size, is_master=False, timeout=start)
            self.host, self.address = host, local_address(host)
            if control:
                self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore(name + "ctrl", self.store), rank, size,
                                                  gloo_options(self.address, start))
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.dev = dist.ProcessGroupNCCL(dist.PrefixStore(name + "dev", self.store), rank, size, opts)
            else:
                self.dev = dist.ProcessGroupGloo(dist.PrefixStore(name + "dev", self.store), rank, size,
                                                 gloo_options(self.address, start))
        except RuntimeError as e:
            raise RankFailed(f"rank {rank}/{size}: the process group at {init_method} did not form "
                             f"within {start.total_seconds():g} s ({e})") from e

    @staticmethod
    def host_store(host: str, size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0: the rendezvous store on a free port of `host` (`init_method(store)` names it),
        listening on that address only (TCPStore's own bind is every interface): a socket bound
        here, handed over to the store."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen()
        except OSError:
            sock.close()
            raise
        return dist.TCPStore(host, sock.getsockname()[1], size, is_master=True,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                             master_listen_fd=sock.detach())

    # ---- the model's reductions -------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        opts = c10d.AllreduceOptions()
        opts.timeout = self.timeout
        self._run(lambda: self.dev.allreduce([x], opts), x.numel() * x.element_size())
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim (rank order): vocab-parallel logits."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = self.timeout
        self._run(lambda: self.dev.allgather([parts], [x.contiguous()], opts), x.numel() * x.element_size() * self.size)
        return torch.cat(parts, -1)

    def all_counts(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order (data-parallel attention: each rank's token count)."""
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = self.timeout
        t0 = time.perf_counter()
        self._run(lambda: self.dev.allgather([parts], [t], opts), 8 * self.size)
        self.stats["counts_s"] += time.perf_counter() - t0
        return [int(p) for p in parts]

    def all_gather_rows(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """Every rank's rows of x concatenated in rank order; `counts` (each rank's rows, from
        `all_counts`) may differ: each part travels padded to the largest."""
        counts = counts if counts is not None else self.all_counts(x.shape[0])
        padded = x.new_zeros((max(counts),) + tuple(x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = self.timeout
        self._run(lambda: self.dev.allgather([parts], [padded], opts), padded.numel() * padded.element_size() * self.size)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    def send_to(self, x: torch.Tensor, dst: int, tag: int) -> None:
        """x (contiguous) to rank `dst`; blocks until it is handed over (EPLB's expert moves)."""
        self._run(lambda: self.dev.send([x], dst, tag), x.numel() * x.element_size())

    def recv_from(self, x: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Rank `src`'s `send_to(.., tag)` into x."""
        self._run(lambda: self.dev.recv([x], src, tag), x.numel() * x.element_size())
        return x

    def _run(self, op, nbytes: int) -> None:
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            op().wait()
            if self.sync_timing and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except RuntimeError as e:     # gloo / NCCL report a dead peer or a timeout this way
            raise RankFailed(f"rank {self.rank}: a collective failed: a rank died or stalled ({e})") from e
        self.stats["collectives"] += 1
        self.stats["collective_bytes"] += nbytes
        self.stats["collective_s"] += time.perf_counter() - t0

    # ---- control messages (rank 0 -> all) -------------------------------------------------------
    def send(self, message: object, starting: bool = False) -> None:
        """Rank 0: broadcast a picklable message (tensors in it travel as CPU bytes);
        `starting`: the ranks may still be loading (START_TIMEOUT_S)."""
        t0 = time.perf_counter()
        data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        timeout = self.start_timeout if starting else None
        self._ctrl(torch.tensor([data.numel()], dtype=torch.long), timeout)
        self._ctrl(data, timeout)
        self.stats["messages"] += 1
        self.stats["message_bytes"] += data.numel()
        self.stats["message_s"] += time.perf_counter() - t0

    def recv(self) -> object:
        """Followers: the next message rank 0 broadcast."""
        n = torch.zeros(1, dtype=torch.long)
        self._ctrl(n, IDLE_TIMEOUT)       # the engine may idle between steps
        data = torch.empty(int(n), dtype=torch.uint8)
        self._ctrl(data)
        return pickle.loads(data.numpy().tobytes())

    def gather_objects(self, obj: object, starting: bool = True) -> list[object]:
        """Every rank's picklable `obj`, in rank order, on every rank. `starting` (start-up
        status) waits up to START_TIMEOUT_S, the ranks may still be loading; else `timeout`."""
        t0 = time.perf_counter()
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = self.start_timeout if starting else self.timeout
        self._wait(self.ctrl.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.long)], opts))
        width = int(max(sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:data.numel()] = data
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self.ctrl.allgather([parts], [padded], opts))
        self.stats["messages"] += 1
        self.stats["message_bytes"] += width * self.size
        self.stats["message_s"] += time.perf_counter() - t0
        return [pickle.loads(p[:int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def _ctrl(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, timeout or self.timeout
        self._wait(self.ctrl.broadcast([t], opts))

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise RankFailed(f"rank {self.rank}: the control channel failed: a rank died or stalled ({e})") from e

    @property
    def remote(self) -> bool:
        """This rank runs on another host than rank 0 (a replica that spans nodes)."""
        return self.address != self.host

    def close(self) -> None:
        for name in ("dev", "ctrl"):
            pg = self.__dict__.pop(name, None)
            if pg is not None and hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except RuntimeError:
                    pass


def local_address(host: str) -> str:
    """This machine's address on its route to `host` (`host` itself when it is this machine's;
    no packet is sent): what a rank listens on and advertises to the others of its replica."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def gloo_options(address: str, timeout: datetime.timedelta) -> dist.ProcessGroupGloo._Options:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return opts


def parse_init_method(init_method: str) -> tuple[str, int]:
    if not init_method.startswith("tcp://") or ":" not in init_method[6:]:
        raise ValueError(f"init_method {init_method!r}: expected tcp://host:port")
    host, _, port = init_method[6:].rpartition(":")
    return host.strip("[]"), int(port)


def init_method(host: str, store: dist.TCPStore) -> str:
    return f"tcp://[{host}]:{store.port}" if ":" in host else f"tcp://{host}:{store.port}"
