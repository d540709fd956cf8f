"""Prompt datasets from local files, and the chat template that turns a question into a prompt.

* ``load_prompt_splits(task, encode, max_prompt_tokens)``: a JSONL or Parquet file (read by
  Hugging Face ``datasets``, locally) -> ``PromptSplits``: the records split by seed into a
  training and a held-out part, prompts longer than the budget dropped (and counted).
* ``ChatTemplate``: the ``chat_template`` of a tokenizer folder rendered with Jinja2 the way
  Hugging Face's ``apply_chat_template`` renders it.
* ``PromptEncoder``: a task's prompt (a question, or chat messages) -> the token ids the
  policy sees.

A record's prompt field holds a question (a string) or chat messages (a list of ``{"role",
"content"}``, rendered by the chat template); the record's other fields ride along
(``PromptRecord.fields``) to a reward that reads them (``[task] reward``).

``task`` is the job's ``[task]`` section (``titan_cotrain.config.job_config.Task``); errors
name its keys.
"""

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TEMPLATE_VARIABLES", "ChatTemplate", "Prompt", "PromptDatasetError", "PromptEncoder", "PromptRecord",
           "PromptSplits", "dataset_format", "load_prompt_splits", "synthetic_prompt_splits", "template_value"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")  # set by the trainer

Prompt = str | list[dict[str, str]]
"""A question, or chat messages ``[{"role": ..., "content": ...}, ...]``."""


class PromptDatasetError(ValueError):
    """A dataset file, its fields or its records do not make prompts; the message names the key."""


@dataclass(frozen=True)
class PromptRecord:
    """One record: its prompt as written (a question, or chat messages), its reference answer
    (``""`` for a task scored by ``[task] reward``, which reads the record itself), its worked
    solution (``""`` when ``[task] solution_field`` is unset) and ``fields``: the whole record,
    every field of the file."""

    prompt: Prompt
    answer: str
    solution: str = ""
    fields: dict = field(default_factory=dict)


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


def _is_chat(prompt) -> bool:
    """Chat messages: a non-empty list of ``{"role": str, "content": str, ...}``."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


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
    fields = {"prompt_field": task.prompt_field}
    if not task.reward:  # a reward by import path reads the record itself
        fields["answer_field"] = task.answer_field
    if task.solution_field:
        fields["solution_field"] = task.solution_field
    for key, name in fields.items():
        if name not in table.column_names:
            raise PromptDatasetError(f"task.{key} = {name!r} is not a field of {path} "
                                     f"(its fields: {', '.join(table.column_names)})")
    records = []
    for i, row in enumerate(table.to_list()):
        prompt = row[task.prompt_field]
        if not (isinstance(prompt, str) and prompt.strip() or _is_chat(prompt)):
            raise PromptDatasetError(f"{path}: record {i}: task.prompt_field {task.prompt_field!r} is "
                                     f"{prompt!r}, not a question (a string) or chat messages (a list of "
                                     '{"role": ..., "content": ...})')
        answer = row[task.answer_field] if "answer_field" in fields else ""
        if answer is None or isinstance(answer, (dict, list)):
            raise PromptDatasetError(f"{path}: record {i}: task.answer_field {task.answer_field!r} is {answer!r}")
        solution = row[task.solution_field] if "solution_field" in fields else ""
        records.append(PromptRecord(prompt, str(answer).strip(), str(solution or ""), row))
    return records


def _held_out_count(task, n: int) -> int:
    """How many of ``n`` records ``[task] eval_size`` / ``eval_fraction`` hold out."""
    count = task.eval_size or round(task.eval_fraction * n)
    if count >= n:
        raise PromptDatasetError(f"task.eval_size / eval_fraction hold out {count} of the {n} records of "
                                 f"{task.dataset_path}: none would be left to train on")
    return count


def load_prompt_splits(task, encode: Callable[[Prompt], list[int]], max_prompt_tokens: int) -> PromptSplits:
    """The records of ``[task] dataset_path``, shuffled by ``task.seed`` and split there: the
    first ``eval_size`` (or ``eval_fraction`` of them) are held out, the rest train. The split depends on the file and
    the seed only; then every record whose prompt (``encode(prompt)``, the chat template
    applied) is longer than ``max_prompt_tokens`` is dropped from its part and counted. A
    prompt the encoder refuses (chat messages without a chat template, a template's
    ``raise_exception``) stops the job, naming the file and the record."""
    records = _read_records(task)
    order = list(range(len(records)))
    random.Random(f"{task.seed}/split").shuffle(order)
    n_held = _held_out_count(task, len(records))
    fits = []
    for i, record in enumerate(records):
        try:
            fits.append(len(encode(record.prompt)) <= max_prompt_tokens)
        except ValueError as e:
            raise PromptDatasetError(f"{task.dataset_path}: record {i}: {e}") from None
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
    chat template's own tokens included; its answer is 1. It is the held-out split's one
    question too (an ``[eval]`` evaluation's, of the same length)."""
    overhead = len(encode(""))
    record = PromptRecord("1" * max(n_tokens - overhead, 1), "1")
    return PromptSplits([record], [record], "synthetic (simulation)")


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """A Jinja2 chat template rendered as Hugging Face renders one: a sandboxed environment
    with ``trim_blocks`` and ``lstrip_blocks`` and the loop controls, ``raise_exception``,
    and the variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``
    (``TEMPLATE_VARIABLES``), plus any the caller adds (``apply_chat_template``'s keyword
    arguments: ``enable_thinking``, ...)."""

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

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens, **variables)


def template_value(value: str | bool | int | float) -> str | bool | int | float:
    """A ``[task] chat_template_kwargs`` value as the template sees it: the strings ``"true"``
    and ``"false"`` (any case) as booleans, so ``{% if enable_thinking %}`` reads a command
    line's ``false`` as Hugging Face's ``enable_thinking=False``."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


class PromptEncoder:
    """A task's prompt -> the token ids the policy sees.

    With a chat template: a question is the user's message, chat messages are taken as they
    are; ``system_prompt``, when set, is the system's message before them (unless the chat
    has a system message of its own). They are rendered with the generation prompt and
    ``template_kwargs`` (``[task] chat_template_kwargs``, through ``template_value``) and
    tokenized without any special token added: the template writes the ones it wants (a
    BOS included), as Hugging Face's ``apply_chat_template`` does, so there is never a second
    BOS. Without one: BOS and the question (the synthetic tasks' prompts); chat messages are
    refused."""

    def __init__(self, tokenizer, template: ChatTemplate | None, system_prompt: str = "",
                 template_kwargs: dict[str, str | bool | int | float] | None = None) -> None:
        template_kwargs = template_kwargs or {}
        for key, value in (("task.system_prompt", system_prompt), ("task.chat_template_kwargs", template_kwargs)):
            if value and template is None:
                raise ValueError(f"{key} is set but the tokenizer has no chat template to put it in "
                                 "(tokenizer_config.json has no chat_template, or task.chat_template is false)")
        if taken := sorted(set(template_kwargs) & set(TEMPLATE_VARIABLES)):
            raise ValueError(f"task.chat_template_kwargs sets {taken}: the trainer sets these template variables")
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.template_kwargs = {key: template_value(value) for key, value in template_kwargs.items()}

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat the template renders for ``prompt``."""
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat

    def render(self, prompt: Prompt) -> str:
        """The prompt as text: the rendered template, or the question itself without one."""
        if self.template is None:
            if not isinstance(prompt, str):
                raise ValueError("a prompt of chat messages needs a chat template: the tokenizer folder has none "
                                 "(chat_template.jinja, or tokenizer_config.json's chat_template), or "
                                 "task.chat_template is false")
            return prompt
        return self.template.render(self.messages(prompt), **self.template_kwargs)

    def __call__(self, prompt: Prompt) -> list[int]:
        from titan_cotrain.components import titan

        if self.template is None:
            return self.tokenizer.encode(self.render(prompt), add_bos=True, add_eos=False)
        return titan.encode_without_special_tokens(self.tokenizer, self.render(prompt))
