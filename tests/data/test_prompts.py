"""Prompt datasets from local files: the chat template rendered as Hugging Face renders it
(checked against strings worked out by hand), one BOS, the seeded held-out split, the
length filter and its count, and one clear error for each bad file or field."""

import json
import shutil
from pathlib import Path

import pytest

from titan_cotrain.components import titan
from titan_cotrain.config.job_config import Task
from titan_cotrain.data.prompts import (
    ChatTemplate,
    PromptDatasetError,
    PromptEncoder,
    load_prompt_splits,
    synthetic_prompt_splits,
)

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"

# Indented block tags and a newline after every tag: what trim_blocks and lstrip_blocks remove.
TEMPLATE = ("{{ bos_token }}"
            "{% for message in messages %}\n"
            "  {% if message['role'] == 'system' %}\n"
            "[{{ message['content'] }}]\n"
            "  {% else %}\n"
            "{{ message['role'] }}: {{ message['content'] }}\n"
            "  {% endif %}\n"
            "{% endfor %}\n"
            "{% if add_generation_prompt %}\n"
            "assistant:"
            "{% endif %}")


def _tokenizer_folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "tokenizer"
    shutil.copytree(ASSETS, folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _task(path: Path, **keys) -> Task:
    return Task(name="math", dataset_path=str(path), **keys)


def _chars(text: str) -> list[int]:
    """A character-level encoder: BOS + one token per character."""
    return [1] + [0] * len(text)


def test_chat_template_renders_as_worked_out_by_hand(tmp_path):
    template = ChatTemplate.from_folder(_tokenizer_folder(tmp_path, chat_template=TEMPLATE))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+3?"}]
    assert template.render(messages) == "<bos>[be brief]\nuser: what is 2+3?\nassistant:"
    assert template.render(messages, add_generation_prompt=False) == "<bos>[be brief]\nuser: what is 2+3?\n"


def test_eos_token_raise_exception_and_named_templates(tmp_path):
    source = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first comes the user') }}{% endif %}"
              "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": source}]
    template = ChatTemplate.from_folder(_tokenizer_folder(tmp_path, chat_template=listed))
    assert template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == \
        "hi<eos>yo<eos>"
    with pytest.raises(ValueError, match="chat template: first comes the user"):
        template.render([{"role": "assistant", "content": "yo"}])
    # A chat_template.jinja file (recent transformers) wins over the key.
    (tmp_path / "tokenizer" / "chat_template.jinja").write_text("<{{ messages[0]['content'] }}>")
    assert ChatTemplate.from_folder(tmp_path / "tokenizer").render([{"role": "user", "content": "q"}]) == "<q>"
    assert ChatTemplate.from_folder(ASSETS) is None


def test_a_template_gives_exactly_one_bos_even_when_the_tokenizer_adds_one(tmp_path):
    folder = _tokenizer_folder(tmp_path, chat_template=TEMPLATE)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = {  # a Llama-3-style tokenizer: its post-processor prepends BOS
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = titan.load_tokenizer(str(folder))
    encode = PromptEncoder(tokenizer, ChatTemplate.from_folder(folder), system_prompt="be brief")
    ids = encode("what is 2+3?")
    text = "<bos>[be brief]\nuser: what is 2+3?\nassistant:"
    assert encode.render("what is 2+3?") == text
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1
    assert len(ids) == len(text) - len("<bos>") + 1  # character-level: one token per character
    assert tokenizer.encode(text, add_bos=False)[:2] == [1, 1]  # what a plain encode would have given
    plain = PromptEncoder(tokenizer, None)
    assert plain("ab").count(tokenizer.bos_id) == 1
    with pytest.raises(ValueError, match="task.system_prompt .* no chat template"):
        PromptEncoder(tokenizer, None, system_prompt="be brief")


def test_held_out_split_is_disjoint_deterministic_and_seeded(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(20)])
    splits = load_prompt_splits(_task(path, eval_size=5), _chars, 100)
    held, train = [r.prompt for r in splits.held_out], [r.prompt for r in splits.train]
    assert len(held) == 5 and len(train) == 15
    assert not set(held) & set(train) and set(held) | set(train) == {f"q{i}" for i in range(20)}
    assert splits.train[0].answer == splits.train[0].prompt[1:]
    again = load_prompt_splits(_task(path, eval_size=5), _chars, 100)
    assert [r.prompt for r in again.held_out] == held and [r.prompt for r in again.train] == train
    assert train != sorted(train, key=lambda q: int(q[1:]))  # shuffled, not in file order
    other = load_prompt_splits(_task(path, eval_size=5, seed=1), _chars, 100)
    assert {r.prompt for r in other.held_out} != set(held)
    assert len(load_prompt_splits(_task(path, eval_fraction=0.25), _chars, 100).held_out) == 5
    with pytest.raises(PromptDatasetError, match="hold out 20 of the 20 records"):
        load_prompt_splits(_task(path, eval_size=20), _chars, 100)


def test_prompts_over_the_budget_are_left_out_and_counted(tmp_path):
    # Prompt lengths (BOS + characters): 2, 3, ..., 11 tokens; a budget of 6 keeps 5 of 10.
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "x" * n, "answer": "1"} for n in range(1, 11)])
    splits = load_prompt_splits(_task(path, eval_size=2), _chars, 6)
    kept = splits.train + splits.held_out
    assert splits.too_long == 5 and sorted(len(r.prompt) for r in kept) == [1, 2, 3, 4, 5]
    assert "5 longer than the prompt budget left out" in splits.summary()
    # The split is made before the filter: a budget does not move records between the parts.
    wide = load_prompt_splits(_task(path, eval_size=2), _chars, 100)
    assert {r.prompt for r in splits.held_out} <= {r.prompt for r in wide.held_out}
    with pytest.raises(PromptDatasetError, match="every training prompt is longer than the 1-token prompt budget"):
        load_prompt_splits(_task(path), _chars, 1)


def test_parquet_fields_and_solutions(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "answer": [2, 4], "solution": ["\\boxed{2}", None]}), path)
    splits = load_prompt_splits(_task(path, prompt_field="problem", solution_field="solution"), _chars, 100)
    records = sorted(splits.train, key=lambda r: r.prompt)
    assert [(r.prompt, r.answer, r.solution) for r in records] == [("1+1?", "2", "\\boxed{2}"), ("2+2?", "4", "")]
    assert splits.held_out == []


def test_bad_files_and_fields_fail_with_one_clear_message(tmp_path):
    with pytest.raises(PromptDatasetError, match=r"task.dataset_path = '.*none.jsonl': no such file"):
        load_prompt_splits(_task(tmp_path / "none.jsonl"), _chars, 100)
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(PromptDatasetError, match=r"task.prompt_field = 'problem' is not a field .* question, answer"):
        load_prompt_splits(_task(path, prompt_field="problem"), _chars, 100)
    with pytest.raises(PromptDatasetError, match="task.answer_field = 'solution' is not a field"):
        load_prompt_splits(_task(path, answer_field="solution"), _chars, 100)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PromptDatasetError, match="empty.jsonl'?: the dataset has no records"):
        load_prompt_splits(_task(tmp_path / "empty.jsonl"), _chars, 100)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(PromptDatasetError, match="not readable as json"):
        load_prompt_splits(_task(tmp_path / "bad.jsonl"), _chars, 100)
    numbers = _write_jsonl(tmp_path / "n.jsonl", [{"question": 7, "answer": "1"}])
    with pytest.raises(PromptDatasetError, match="record 0: task.prompt_field 'question' is 7, not a question"):
        load_prompt_splits(_task(numbers), _chars, 100)
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(PromptDatasetError, match=r"extension '.csv' .* set task.dataset_format"):
        load_prompt_splits(_task(tmp_path / "d.csv"), _chars, 100)


def test_simulated_prompts_have_the_asked_length():
    splits = synthetic_prompt_splits(lambda text: [1, 5, 5] + [0] * len(text), 40)  # a 3-token template
    assert [len(r.prompt) + 3 for r in splits.train] == [40] and splits.held_out == splits.train  # [eval]'s too


# A template that reads apply_chat_template's enable_thinking, as Qwen3's does.
THINKING = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant{% if enable_thinking is false %} (no thinking){% endif %}: "
            "{% endif %}")


def test_chat_messages_render_through_the_template_with_its_kwargs_and_the_records_ride_along(tmp_path):
    folder = _tokenizer_folder(tmp_path, chat_template=THINKING)
    tokenizer, template = titan.load_tokenizer(str(folder)), ChatTemplate.from_folder(folder)
    encode = PromptEncoder(tokenizer, template, system_prompt="be brief", template_kwargs={"enable_thinking": "false"})
    own_system = [{"role": "system", "content": "be exact"}, {"role": "user", "content": "2+3?"}]
    assert encode.render(own_system) == "<bos>system: be exact\nuser: 2+3?\nassistant (no thinking): "
    assert encode.render([own_system[1]]) == "<bos>system: be brief\nuser: 2+3?\nassistant (no thinking): "
    assert encode.render("2+3?") == "<bos>system: be brief\nuser: 2+3?\nassistant (no thinking): "
    assert encode([own_system[1]]) == encode("2+3?")  # the question is the user's message
    for thinking in ({"enable_thinking": "True"}, {"enable_thinking": True}, {}):  # "true" any case; unset
        assert PromptEncoder(tokenizer, template, template_kwargs=thinking).render("q") == "<bos>user: q\nassistant: "

    # A custom task's file: chat messages, no answer field (its reward reads the record), extra fields kept.
    records = [{"messages": [{"role": "user", "content": f"{i}+1?"}], "id": i, "tests": [i + 1]} for i in range(4)]
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    task = Task(name="custom", reward="tests.rl.reward_fixtures:graded", dataset_path=str(path),
                prompt_field="messages")
    splits = load_prompt_splits(task, encode, 100)
    assert sorted((r.fields for r in splits.train), key=lambda f: f["id"]) == records
    assert all(r.prompt == r.fields["messages"] and r.answer == "" for r in splits.train)


def test_chat_messages_without_a_template_are_refused_naming_the_file(tmp_path):
    folder = _tokenizer_folder(tmp_path, chat_template=THINKING)
    tokenizer = titan.load_tokenizer(str(folder))
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "q"}], "answer": "1"}])
    with pytest.raises(PromptDatasetError, match=f"{path}: record 0: a prompt of chat messages needs a chat template: "
                                                 "the tokenizer folder has none .* or task.chat_template is false"):
        load_prompt_splits(_task(path, prompt_field="messages"), PromptEncoder(tokenizer, None), 100)
    no_content = _write_jsonl(tmp_path / "roles.jsonl", [{"messages": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(PromptDatasetError, match=r"record 0: task.prompt_field 'messages' is \[\{'role': 'user'\}\], "
                                                 "not a question .* or chat messages"):
        load_prompt_splits(_task(no_content, prompt_field="messages"), _chars, 100)
    with pytest.raises(ValueError, match="task.chat_template_kwargs is set but the tokenizer has no chat template"):
        PromptEncoder(tokenizer, None, template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match=r"task.chat_template_kwargs sets \['messages'\]: the trainer sets"):
        PromptEncoder(tokenizer, ChatTemplate.from_folder(folder), template_kwargs={"messages": "x"})


def test_chat_template_kwargs_from_toml_and_the_command_line_reach_the_template(tmp_path):
    from titan_cotrain.config import ConfigError, load_job_config

    folder = _tokenizer_folder(tmp_path, chat_template=THINKING)
    tokenizer, template = titan.load_tokenizer(str(folder)), ChatTemplate.from_folder(folder)

    def rendered(config) -> str:
        return PromptEncoder(tokenizer, template, template_kwargs=config.task.chat_template_kwargs).render("q")

    job = tmp_path / "job.toml"
    job.write_text("[task]\nchat_template_kwargs = { enable_thinking = false, budget = 3 }\n")
    from_toml = load_job_config(["--job.config_file", str(job)], world_size=1)
    assert from_toml.task.chat_template_kwargs == {"enable_thinking": False, "budget": 3}
    assert rendered(from_toml) == "<bos>user: q\nassistant (no thinking): "
    overridden = load_job_config(["--job.config_file", str(job), "--task.chat_template_kwargs.enable_thinking"],
                                 world_size=1)
    assert overridden.task.chat_template_kwargs == {"enable_thinking": True, "budget": 3}
    assert rendered(overridden) == "<bos>user: q\nassistant: "
    from_cli = load_job_config(["--task.chat_template_kwargs", "enable_thinking", "false"], world_size=1)
    assert rendered(from_cli) == "<bos>user: q\nassistant (no thinking): "
    job.write_text("[task]\nchat_template_kwargs = { enable_thinking = [false] }\n")
    with pytest.raises(ConfigError, match=r"chat_template_kwargs must be dict\[str, bool \| int \| float \| str\]"):
        load_job_config(["--job.config_file", str(job)], world_size=1)
