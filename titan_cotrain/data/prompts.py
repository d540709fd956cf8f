"""Prompt datasets from local files, and the chat template that turns a question into a prompt.

* ``load_prompt_splits(task, encode, max_prompt_tokens)``: a JSONL or Parquet file (read by
  Hugging Face ``datasets``, locally) -> ``PromptSplits``: the records split by seed into a
  training and a held-out part, prompts longer than the budget dropped (and counted).
* ``ChatTemplate``: the ``chat_template`` of a tokenizer folder rendered with Jinja2 the way
  Hugging Face's ``apply_chat_template`` renders it.
* ``PromptEncoder``: a task's prompt text -> the token ids the policy sees.

``task`` is the job's ``[task]`` section (``titan_cotrain.config.job_config.Task``); errors
name its keys.
"""

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ChatTemplate", "PromptDatasetError", "PromptEncoder", "PromptRecord", "PromptSplits", "dataset_format",
           "load_prompt_splits", "synthetic_prompt_splits"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class PromptDatasetError(ValueError):
    """A dataset file, its fields or its records do not make prompts; the message names the key."""


@dataclass(frozen=True)
class PromptRecord:
    """One record: the question as written, its reference answer and its worked solution
    (``""`` when ``[task] solution_field`` is unset)."""

    question: str
    answer: str
    solution: str = ""


@dataclass(frozen=True)
class PromptSplits:
    """The records of ``source`` in a seeded order, ``held_out`` (the evaluation prompts)
    disjoint from ``train``; ``too_long``: records of both dropped by the length filter."""

    train: list[PromptRecord]
    held_out: list[PromptRecord]
    source: str
    too_long: int = 0

    def summary(self) -> str:
        return (f"{self.source}: {len(self.train)} training and {len(self.held_out)} held-out prompts"
                f" ({self.too_long} longer than the prompt budget left out)")


def dataset_format(task) -> str:
    """``[task] dataset_format``, or the one ``dataset_path``'s extension names."""
    if task.dataset_format:
        return task.dataset_format
    suffix = Path(task.dataset_path).suffix.lower()
    if suffix not in FORMATS:
        raise PromptDatasetError(f"task.dataset_path = {task.dataset_path!r}: cannot tell the format from the "
                                 f"extension {suffix!r} ({', '.join(FORMATS)}): set task.dataset_format")
    return FORMATS[suffix]


def _read_records(task) -> list[PromptRecord]:
    path = task.dataset_path
    if not os.path.isfile(path):
        raise PromptDatasetError(f"task.dataset_path = {path!r}: no such file")
    fmt = dataset_format(task)
    if os.path.getsize(path) == 0:  # datasets fails on an empty file with no message
        raise PromptDatasetError(f"task.dataset_path = {path!r}: the dataset has no records")
    import datasets

    datasets.disable_progress_bars()  # one bar per rank per split would bury the job's log
    try:
        table = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many kinds for a malformed file
        raise PromptDatasetError(f"task.dataset_path = {path!r}: not readable as {fmt}: "
                                 f"{type(e).__name__}: {e}") from None
    if len(table) == 0:
        raise PromptDatasetError(f"task.dataset_path = {path!r}: the dataset has no records")
    fields = {"prompt_field": task.prompt_field, "answer_field": task.answer_field}
    if task.solution_field:
        fields["solution_field"] = task.solution_field
    for key, name in fields.items():
        if name not in table.column_names:
            raise PromptDatasetError(f"task.{key} = {name!r} is not a field of {path} "
                                     f"(its fields: {', '.join(table.column_names)})")
    columns = {key: table[name] for key, name in fields.items()}
    records = []
    for i in range(len(table)):
        question, answer = columns["prompt_field"][i], columns["answer_field"][i]
        if not isinstance(question, str) or not question.strip():
            raise PromptDatasetError(f"{path}: record {i}: task.prompt_field {task.prompt_field!r} is "
                                     f"{question!r}, not a question")
        if answer is None or isinstance(answer, (dict, list)):
            raise PromptDatasetError(f"{path}: record {i}: task.answer_field {task.answer_field!r} is {answer!r}")
        solution = columns["solution_field"][i] if "solution_field" in columns else ""
        records.append(PromptRecord(question, str(answer).strip(), str(solution or "")))
    return records


def _held_out_count(task, n: int) -> int:
    """How many of ``n`` records ``[task] eval_size`` / ``eval_fraction`` hold out."""
    count = task.eval_size or round(task.eval_fraction * n)
    if count >= n:
        raise PromptDatasetError(f"task.eval_size / eval_fraction hold out {count} of the {n} records of "
                                 f"{task.dataset_path}: none would be left to train on")
    return count


def load_prompt_splits(task, encode: Callable[[str], list[int]], max_prompt_tokens: int) -> PromptSplits:
    """The records of ``[task] dataset_path``, shuffled by ``task.seed`` and split there: the
    first ``eval_size`` (or ``eval_fraction`` of them) are held out, the rest train. The split depends on the file and
    the seed only; then every record whose prompt (``encode(question)``, the chat template
    applied) is longer than ``max_prompt_tokens`` is dropped from its part and counted."""
    records = _read_records(task)
    order = list(range(len(records)))
    random.Random(f"{task.seed}/split").shuffle(order)
    n_held = _held_out_count(task, len(records))
    fits = [len(encode(r.question)) <= max_prompt_tokens for r in records]
    held = [records[i] for i in order[:n_held] if fits[i]]
    train = [records[i] for i in order[n_held:] if fits[i]]
    if not train:
        raise PromptDatasetError(f"task.dataset_path = {task.dataset_path!r}: every training prompt is longer than "
                                 f"the {max_prompt_tokens}-token prompt budget (rollout.max_prompt_tokens, or "
                                 "training.seq_len - rollout.max_new_tokens)")
    return PromptSplits(train, held, str(task.dataset_path), too_long=fits.count(False))


def synthetic_prompt_splits(encode: Callable[[str], list[int]], n_tokens: int) -> PromptSplits:
    """What a dataset task trains on under the scale simulator, which never reads the file:
    one question of digits whose prompt is ``n_tokens`` long under a character-level
    tokenizer (the project's, which the simulator uses without ``[model] hf_path``), the
    chat template's own tokens included; its answer is 1."""
    overhead = len(encode(""))
    return PromptSplits([PromptRecord("1" * max(n_tokens - overhead, 1), "1")], [], "synthetic (simulation)")


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """A Jinja2 chat template rendered as Hugging Face renders one: a sandboxed environment
    with ``trim_blocks`` and ``lstrip_blocks`` and the loop controls, ``raise_exception``,
    and the variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.special_tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ChatTemplate | None":
        """The template of a tokenizer folder: ``chat_template.jinja`` (what recent
        ``transformers`` write) or ``tokenizer_config.json``'s ``chat_template`` (a string,
        or a list of named templates, of which ``default``); None when it has neither."""
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(f"{config_path}: chat_template lists {sorted(named)}, none named 'default'")
            source = named["default"]
        if not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens)


class PromptEncoder:
    """A task's prompt text -> the token ids the policy sees.

    With a chat template: the text is the user's message (after ``system_prompt`` as the
    system's, when set), rendered with the generation prompt and tokenized without any
    special token added: the template writes the ones it wants (a BOS included), as Hugging
    Face's ``apply_chat_template`` does, so there is never a second BOS. Without one: BOS and
    the text (the synthetic tasks' prompts)."""

    def __init__(self, tokenizer, template: ChatTemplate | None, system_prompt: str = "") -> None:
        if system_prompt and template is None:
            raise ValueError("task.system_prompt is set but the tokenizer has no chat template to put it in "
                             "(tokenizer_config.json has no chat_template, or task.chat_template is false)")
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt

    def render(self, text: str) -> str:
        """The prompt as text: the rendered template, or ``text`` itself without one."""
        if self.template is None:
            return text
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return self.template.render(system + [{"role": "user", "content": text}])

    def __call__(self, text: str) -> list[int]:
        from titan_cotrain.components import titan

        if self.template is None:
            return self.tokenizer.encode(text, add_bos=True, add_eos=False)
        return titan.encode_without_special_tokens(self.tokenizer, self.render(text))
