"""The stage processes one executor drives: where each role is served, the shared memory they attach, and the
``Configure`` call that attaches them (at start, and again after a loss: then a warm standby is tried first).

Every address of a role: the first stage process, then its warm standby (model loaded, no session). A lost stage
is re-attached on another address of its role first: a process that is already up. Each ``Configure`` reply
tells the process serving the role (its pid, for the hang watchdog's kill), its configuration digest, and whether
it reads op records on its ring.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import Stage
from services.settings import Settings
from services.transport import records
from services.transport.bank import SharedBank
from services.transport.convert import bank_spec_to_pb, role_to_pb
from services.transport.fences import FenceBoard
from services.transport.links import LinkOwner, Rings, StageLink, channel_options
from services.transport.ring import Doorbell
from services.transport.watchdog import ProcessId, is_stopped, kill

_STANDBY_WAIT_S = 0.5  # how long a re-attach waits for a standby before it tries the lost stage's own address

log = logging.getLogger("cdb.executor")


class StageSet:
    """The three stages of one scheduler session (module docstring). ``addrs`` and ``channels``: the address and
    channel each stage is served on now (a standby may take over); ``bank`` and ``tokens``: the hidden-state and
    token banks, created here."""

    def __init__(
        self,
        setup: StageSetup,
        addrs: Mapping[Stage, str],
        standby_addrs: Mapping[Stage, str] | None,
        settings: Settings,
        metadata: Sequence[tuple[str, str]],
        holder: str,
        doorbell: Doorbell | None,
    ) -> None:
        self.setup = setup
        self.settings = settings
        self.metadata = tuple(metadata)
        self.holder = holder
        self.doorbell = doorbell  # the replies doorbell the stages ring (rings only; renewed with the banks)
        self.addrs = dict(addrs)
        self.role_addrs = {
            s: [a, *([standby_addrs[s]] if standby_addrs and s in standby_addrs else [])] for s, a in addrs.items()
        }
        self.channels: dict[Stage, grpc.Channel] = {}
        self._by_addr: dict[str, grpc.Channel] = {}
        self.procs: dict[Stage, ProcessId] = {}  # each stage's process, from its last Configure reply
        self.config_digests: dict[Stage, str] = {}  # each stage process's configuration digest, from the same
        self._op_records: dict[Stage, bool] = {}  # whether each stage reads op records on its ring (same reply)
        bank_device = setup.device if setup.device.startswith("cuda") else "cpu"
        self.bank = SharedBank.create(setup.bank_rows, setup.bank_width, setup.dtype, bank_device)
        self.tokens = SharedBank.create(setup.bank_rows, 1, "int64", bank_device)

    def connect(self) -> None:
        """Open every stage's channel and wait until it is ready (bounded); standbys connect in the background."""
        for stage in Stage:
            address = self.addrs[stage]
            channel = self._by_addr[address] = grpc.insecure_channel(address, options=channel_options(self.settings))
            self.channels[stage] = channel
            try:
                grpc.channel_ready_future(channel).result(timeout=self.settings.stage_connect_timeout_s)
            except grpc.FutureTimeoutError:
                raise ConnectionError(f"{stage.role} stage at {address} not reachable") from None
            for other in self.role_addrs[stage][1:]:
                self._by_addr[other] = grpc.insecure_channel(other, options=channel_options(self.settings))

    def configure(
        self,
        stage: Stage,
        fences: FenceBoard,
        rings: Rings | None,
        timeout: float | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        """Attach ``stage`` (on ``channel``, default its current one) to the banks, ``fences`` and ``rings``."""
        s = self.setup
        request = pb.ConfigureRequest(
            role=role_to_pb(stage),
            model=s.model,
            dtype=s.dtype,
            bank=bank_spec_to_pb(self.bank.spec),
            token_bank=bank_spec_to_pb(self.tokens.spec),
            fences=pb.FenceBoardSpec(name=fences.name),
            kv=pb.KVSpec(
                policy=s.kv_policy,
                max_depth=s.max_depth,
                shared_after=s.kv_shared_after,
                num_blocks=s.num_kv_blocks,
                block_size=s.kv_block_size,
            ),
            holder=self.holder,
            device=s.device,
        )
        if rings is not None:
            request.rings.ops, request.rings.replies = rings[0].name, rings[1].name
            if self.doorbell is not None:
                request.rings.doorbell = self.doorbell.name
        stub = stage_pb2_grpc.StageStub(channel or self.channels[stage])
        reply = stub.Configure(
            request,
            timeout=timeout or self.settings.stage_connect_timeout_s,
            wait_for_ready=True,
            metadata=self.metadata,
        )
        p = reply.process
        self.procs[stage] = ProcessId(p.pid, p.pid_namespace, p.start_ticks)
        self._op_records[stage] = rings is not None and reply.op_records == records.VERSION
        self.config_digests[stage] = reply.config_digest

    def attach(self, stage: Stage, lost: bool, board: FenceBoard, rings: Rings | None, timeout: float) -> str:
        """Configure ``stage`` on one of its role's addresses; return that address. A lost stage tries the role's
        other addresses first (a warm standby answers at once; the lost process may still be restarting), each
        briefly, then waits for its own address as usual."""
        current = self.addrs[stage]
        if lost:
            for address in self.role_addrs[stage]:
                if address == current:
                    continue
                try:
                    channel = self._by_addr[address]
                    self.configure(stage, board, rings, timeout=_STANDBY_WAIT_S, channel=channel)
                except grpc.RpcError as exc:
                    log.info("%s stage standby at %s not available (%s)", stage.role, address, exc.code().name)
                    continue
                log.warning("%s stage: its standby at %s takes over", stage.role, address)
                return address
        self.configure(stage, board, rings, timeout=timeout)
        return current

    def move(self, moved: Mapping[Stage, str]) -> None:
        """Serve each stage of ``moved`` from its new address (where it was attached) from now on."""
        for stage, address in moved.items():
            self.channels[stage] = self._by_addr[address]
            self.addrs[stage] = address

    def link(self, stage: Stage, owner: LinkOwner, epoch: int, rings: Rings | None) -> StageLink:
        """A new ``Run`` stream to ``stage`` (on ``rings`` if any), reporting to ``owner``."""
        timeout = self.settings.stage_hang_floor_s
        op_records = self._op_records.get(stage, False)
        channel = self.channels[stage]
        return StageLink(stage, channel, owner, epoch, self.metadata, rings, timeout, op_records)

    def renew_segments(self) -> None:
        """Recreate a bank or the doorbell whose name was unlinked meanwhile (by hand, or a ``/dev/shm`` cleaner):
        no stage could attach it. (The rings are new at every re-attachment.)"""
        for bank in (self.bank, self.tokens):
            bank.renew_if_unlinked()
        if self.doorbell is not None:
            self.doorbell.renew_if_unlinked()

    def kill_stopped(self) -> None:
        """SIGKILL a stage process of this host found stopped (lost to keepalive while stopped: it would never
        answer); its supervisor restarts it."""
        for stage, proc in list(self.procs.items()):
            if proc.local and is_stopped(proc) and kill(proc):
                log.error("%s stage process %d is stopped: killed, its supervisor restarts it", stage.role, proc.pid)

    def close(self) -> None:
        """Close every channel and free the banks."""
        for channel in {*self.channels.values(), *self._by_addr.values()}:
            channel.close()
        self.bank.close()
        self.tokens.close()
