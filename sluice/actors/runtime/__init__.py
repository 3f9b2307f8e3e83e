"""A small actor runtime over asyncio: bounded mailboxes, lifecycle, supervision, a thread for
blocking step loops, and an ActorSystem with ordered, signal-driven shutdown. No Kafka, no Redis,
no engine: the pipeline's actors build on it."""

from sluice.actors.runtime.actor import Actor, ActorFailed, ActorState
from sluice.actors.runtime.mailbox import Mailbox, MailboxClosed, MailboxFull
from sluice.actors.runtime.supervisor import Decision, RestartPolicy, Supervisor
from sluice.actors.runtime.system import ActorSystem
from sluice.actors.runtime.worker import (
    ThreadedWorker,
    WorkerFailed,
    WorkerStopped,
    in_passing_thread,
)

__all__ = [
    "Actor",
    "ActorFailed",
    "ActorState",
    "ActorSystem",
    "Decision",
    "Mailbox",
    "MailboxClosed",
    "MailboxFull",
    "RestartPolicy",
    "Supervisor",
    "ThreadedWorker",
    "WorkerFailed",
    "WorkerStopped",
    "in_passing_thread",
]
