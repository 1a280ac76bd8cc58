"""The model's side of a server: one thread that answers requests one at a time, each from a
kept read (`Reader`), from a bounded queue (`Worker`)."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from longkv.decoding import Pick
from longkv.document.read import Answer, ReadSettings, read_ids
from longkv.serve.kept import KeptReads, Key
from longkv.serve.store import Store


@dataclass
class Job:
    """A request for the model: the settings it is read by (`Reader.settings_for` of its
    positions), the context to read (or find kept) and the rest of the prompt, answered in at
    most max_tokens tokens chosen by pick, stopped where it starts to repeat itself with
    stop_at_repeat (`Document.answer`); emit sees the answer's text in pieces as they come (from
    the worker's thread); cancel stops it (before it starts, or after any token); done sees its
    `Outcome`, or the exception it raised."""

    settings: ReadSettings
    context: list[int]
    rest: list[int]
    max_tokens: int
    pick: Pick
    stop_at_repeat: bool
    emit: Callable[[str], object]
    done: Callable[[Outcome | BaseException], object]
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    """A job's answer, the prompt's tokens, and how many of them a kept read had read."""

    answer: Answer
    prompt_tokens: int
    cached_tokens: int
    label: str

    def finish_reason(self, max_tokens: int) -> str:
        """OpenAI's: "length" where the answer took every token it could, else "stop"."""
        return "length" if len(self.answer.tokens) >= max_tokens else "stop"


class Reader:
    """A model that answers jobs from kept reads: settings_for gives the settings a job of so
    many positions is read by (refusing, with a SettingError, what the model cannot read); a
    job's context is read by them, continuing the longest kept read it begins with
    (`Document.extend`), and kept; with a store, the reads kept are saved after their answers
    (`save_kept`) and dropped with them."""

    def __init__(
        self, model: nn.Module, tokenizer: Any, settings_for: Callable[[int], ReadSettings],
        kept: KeptReads, store: Store | None = None,
    ) -> None:  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self.settings_for, self.kept, self.store = settings_for, kept, store
        self.unsaved: list[Key] = []
        if store is not None:
            kept.on_drop = store.drop
            for key, doc in store.load():
                kept.keep(*key, doc)

    def __call__(self, job: Job) -> Outcome:
        s = job.settings
        doc, cached = self.kept.find(s.label, job.context)
        if doc is None:
            doc = read_ids(self.model, self.tokenizer, job.context, s, progress=False)
        elif cached < len(job.context):
            doc = doc.extend(job.context[cached:])
        if cached < len(job.context) and self.kept.keep(s.label, job.context, doc):
            self.unsaved.append((s.label, tuple(job.context)))
        answer = doc.answer(
            job.rest, job.max_tokens, pick=job.pick, on_text=job.emit,
            stop_at_repeat=job.stop_at_repeat, cancelled=job.cancel.is_set,
        )  # fmt: skip
        prompt = len(job.context) + len(job.rest)
        print(
            f"{s.label}: {prompt} prompt tokens ({cached} from a kept read), "
            f"{len(answer.tokens)} answered in {answer.seconds:.1f} s",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        return Outcome(answer, prompt, cached, s.label)

    def save_kept(self) -> None:
        """Save the reads kept since the last call and kept still (with a store)."""
        unsaved, self.unsaved = self.unsaved, []
        for key in unsaved:
            if self.store is not None and key in self.kept.reads:
                self.store.save(key, self.kept.reads[key])


class Worker:
    """One thread that runs `answer` on the jobs submitted, one at a time, in order, and `after`
    once each job has its outcome; at most `waiting` jobs wait (`submit` refuses more)."""

    def __init__(
        self, answer: Callable[[Job], Outcome], waiting: int,
        after: Callable[[], object] = lambda: None,
    ) -> None:  # fmt: skip
        self.answer, self.after = answer, after
        self.running = False  # whether a job is being answered now
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=waiting)
        self.thread = threading.Thread(target=self.loop, name="longkv-serve-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> bool:
        """Queue job; False where the queue is full."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():  # its client left while it waited
                continue
            self.running = True
            try:
                job.done(self.answer(job))
            except Exception as err:  # the job's own failure, told to its client
                job.done(err)
            self.running = False
            self.after()

    def stop(self) -> None:
        """Finish the job in flight and the jobs waiting, then end the thread."""
        self.jobs.put(None)
        self.thread.join()
