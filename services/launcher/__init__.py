"""The process tree on this machine: three stage servers, then the scheduler service, as child processes.

- ``serve_all(config, listen) -> ServeHandle``: starts the stages (Unix sockets in a private temp dir) and the
  scheduler (``cdb stage`` / ``cdb scheduler``), waits until each one is ready, returns a handle (``address``,
  ``stop()``).
- ``start_stages(config)``: only the three stages (benchmarks drive them from an in-process engine).
- ``serve_forever(resolved, listen)``: ``serve_all``, then serve until SIGTERM / SIGINT (Ctrl-C) / SIGHUP (a closed
  terminal), and stop every child (scheduler first, so it drains; then the stages).

The package: ``tree`` (starting the tree and waiting for its readiness), ``commands`` (each child's command line),
``supervisor`` (``ServeHandle``, the owner thread that starts, restarts and stops the children), ``restarts`` (when
a child is restarted or given up on), ``foreground`` (``serve_forever``: serving until a signal), ``child`` (what a
child does at its own start: die with the launcher, pin its CPUs).

Supervision: the handle restarts a child that dies (same command, same address): a restarted stage is re-attached by
the scheduler, which recomputes the requests it was running; a restarted scheduler re-configures the stages (they
dropped the dead one's session). A stage that hangs is the scheduler's to judge: its watchdog SIGKILLs the stuck
process (``services.transport.watchdog``) and the handle restarts it like any dead stage, so the scheduler itself is
never restarted for a stage's fault. One thread of the handle, the tree's owner, starts, restarts and stops every
child, and lives until the tree has stopped: a child's ``PR_SET_PDEATHSIG`` follows the thread that forked it, so
children started anywhere else would die with that thread, cutting a drain short.

- A child's *streak* counts its exits in a row with no readiness in between (its ready file is removed before
  each restart and written again once it serves), however long each try lasted. The first exit restarts it at
  once; each further one waits ``CDB_RESTART_BACKOFF_S`` (0.5 s), doubling, at most ``CDB_RESTART_BACKOFF_MAX_S``
  (30 s). The ``CDB_RESTART_LIMIT``-th (5th) exit of a streak gives up on the child.
- Giving up, and failing to start a child again (a missing or broken interpreter, no file descriptors left), stop
  the tree with one error line (logger ``cdb.launcher``); ``serve_forever`` then exits 1. So does a scheduler
  that dies while listening on port 0 (a restart would move it).

Configuration: the tree's ``Resolved`` configuration (its engine config and settings) is written once, as one JSON
document in the private work dir (mode 0600), and every child gets ``--resolved-config FILE`` beside the options
of its own place in the tree (role, addresses, ready file): no setting is re-serialised into a child's argv or
environment, and the child reads neither its ``CDB_*`` variables nor a config file. The stage plane's secret:
unless the settings name one (``CDB_STAGE_SECRET_FILE`` / ``CDB_STAGE_SECRET``), the tree makes its own in the work
dir (mode 0600) and the document names it. Front ends get a document of their own that names the front-end link's
secret instead (``link.secret``, derived from the stage secret), and an environment without the stage secret's
variables: a front end faces the public, and one taken over must not reach the stages.

Readiness: each child writes its bound address to a ready file (``services.net.write_ready_file``) once it
serves (the scheduler: once its health is SERVING); the launcher waits for those files and fails fast if a
child exits first.

Shared memory: a start sweeps the segments that trees SIGKILLed whole left in ``/dev/shm``
(``services.transport.segments``).
"""

# What the benchmarks import from the package itself
from services.launcher.supervisor import ServeHandle as ServeHandle
from services.launcher.tree import serve_all as serve_all
from services.launcher.tree import start_stages as start_stages
