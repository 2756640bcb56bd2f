"""Chat prompts: messages rendered by the checkpoint's own chat template, as transformers renders them.

A tiny checkpoint saved by transformers gets a word-level tokenizer.json and a tokenizer_config.json
with a Jinja template in DeepSeek's style (a BOS token, "User: ..." and "Assistant: ..." turns), and
every rendering is compared with transformers' `apply_chat_template` on the same files.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import mla_func as mf
import mla_func.cli.commands as cli
from mla_func.checkpoint.chat_template import ChatError, ChatTemplate, read_chat_template
from mla_func.checkpoint.files import CheckpointError, CheckpointFolder
from mla_func.serving.engine import Engine, RequestError
from mla_func.serving.sampling import SamplingParams
from support.mla_reference import make_reference, save_reference

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
WORDS = ["<unk>", BOS, EOS, "User", "Assistant", ":", ".", ",", "!", "?", "hello", "hi", "there", "you", "are", "a",
         "helpful", "assistant", "write", "code", "add", "two", "numbers", "def", "return", "please", "thanks"]
# DeepSeek-style, in this test's own words: a system message first (or none), then alternating turns,
# each assistant turn closed by EOS; the generation prompt opens the assistant's turn.
TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system_seen=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('a system message must come first') }}{% endif %}"
    "{% set ns.system_seen = true %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "you are a helpful assistant."}, {"role": "user", "content": "write code"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there!"},
     {"role": "user", "content": "add two numbers, please"}],
    [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": ""}],
]


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([BOS, EOS])
    # As DeepSeek's tokenizer does: plain encoding adds BOS, which a chat's template writes itself.
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = save_reference(make_reference("v3-qlora-noaux"), tmp_path_factory.mktemp("chat"))
    _tokenizer().save(str(path / "tokenizer.json"))
    # bos_token as an AddedToken dict, eos_token as a string: both forms appear in real checkpoints.
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "rstrip": False},
        "eos_token": EOS, "chat_template": TEMPLATE,
    }))
    return path


@pytest.fixture(scope="module")
def model(folder):
    return mf.load_model(folder, device="cpu")


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=BOS, eos_token=EOS)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def engine(model):
    return Engine(model, block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)


def error_of(completion):
    assert completion.finish_reason == "error" and completion.token_ids == ()
    assert isinstance(completion.error, RequestError)
    return str(completion.error)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS)
def test_rendering_matches_transformers(model, hf_tokenizer, chat, add_generation_prompt):
    assert model.chat_template == ChatTemplate(TEMPLATE, bos_token=BOS, eos_token=EOS)
    got = model.chat_template.render(chat, add_generation_prompt=add_generation_prompt)
    want = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert got.startswith(BOS) and got.endswith("Assistant:") == add_generation_prompt


def test_a_chat_prompt_gives_the_tokens_of_its_rendered_text(model, hf_tokenizer):
    texts = [model.chat_template.render(chat) for chat in CHATS]
    ids = [model.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    # transformers tokenizes a chat the same way: no BOS besides the template's own.
    assert ids == [hf_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False) for chat in CHATS]
    assert all(i[0] == 1 and i.count(1) == 1 for i in ids)
    chats = engine(model).generate(CHATS, GREEDY)
    plain = engine(model).generate(ids, GREEDY)
    assert [c.prompt_token_ids for c in chats] == [tuple(i) for i in ids]
    assert [c.raise_for_error().token_ids for c in chats] == [c.raise_for_error().token_ids for c in plain]
    # A list of messages alone is one chat prompt, streamed like any other.
    one = engine(model).generate(CHATS[1], GREEDY)
    assert [c.token_ids for c in one] == [chats[1].token_ids]
    events = [e.token_id for e in engine(model).generate_stream([CHATS[2]], GREEDY)]
    assert tuple(events) == chats[2].token_ids


@pytest.mark.parametrize("bad, message", [
    ([{"role": "robot", "content": "hi"}], "request 1: chat: message 0: role 'robot' is not one of system, user, "
                                           "assistant"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 7}], "request 1: chat: message 1: content must be "
                                                                          "a string, got int"),
    ([{"role": "user"}], "request 1: chat: message 0: no 'content'"),
    ([{"role": "user", "content": "hi", "name": "bob"}], "request 1: chat: message 0: unknown fields 'name'; "
                                                         "a message has 'role' and 'content'"),
    ([{"role": "user", "content": "hi"}, "hello"], "request 1: chat: message 1: must be a dict with 'role' and "
                                                   "'content', got str"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
     "request 1: chat: chat template: a system message must come first"),
    ({"role": "user", "content": "hi"}, "request 1: the prompt must be a string or a list/tuple/range of token ids, "
                                        "got dict"),
    ([], "request 1: the prompt is empty"),
])
def test_bad_chats_fail_alone_by_name(model, bad, message):
    e = engine(model)
    got = e.generate([CHATS[0], bad, CHATS[1]], GREEDY)
    assert [c.token_ids for c in (got[0], got[2])] == [c.token_ids for c in engine(model).generate(
        [CHATS[0], CHATS[1]], GREEDY)]
    assert error_of(got[1]) == message
    assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks


@pytest.mark.parametrize("messages, message", [
    ("hello", "a chat must be a list of messages"),
    ([], "the chat has no messages"),
    ([{"role": "user", "content": None}], "message 0: content must be a string, got NoneType"),
    ([{"role": 3, "content": "hi"}], "message 0: role 3 is not one of"),
    ([{"content": "hi"}], "message 0: no 'role'"),
])
def test_render_refuses_bad_messages_by_name(model, messages, message):
    with pytest.raises(ChatError, match=message):
        model.chat_template.render(messages)
    with pytest.raises(ChatError, match="add_generation_prompt must be a bool"):
        model.chat_template.render(CHATS[0], add_generation_prompt="yes")


def test_a_model_without_a_template_refuses_a_chat_by_name(model):
    bare = mf.Model(config=model.config, params=model.params, tokenizer=model.tokenizer)
    got = engine(bare).generate([CHATS[0], [5, 6]], GREEDY)
    assert error_of(got[0]).startswith("request 0: the prompt is a chat (a list of messages) but the model has no "
                                       "chat template")
    assert got[1].finish_reason == "length"


def test_template_sources_in_a_folder(folder, tmp_path):
    # Without a template: None. A list of named templates: the "default" one.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
    assert read_chat_template(CheckpointFolder.at(tmp_path)) is None
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "chat_template": named}))
    assert read_chat_template(CheckpointFolder.at(tmp_path)) == ChatTemplate(TEMPLATE, bos_token=BOS)
    # chat_template.jinja wins over tokenizer_config.json's, as in transformers.
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[-1]['content'] }}")
    template = read_chat_template(CheckpointFolder.at(tmp_path))
    assert template is not None and template.render(CHATS[0]) == BOS + "hello"


@pytest.mark.parametrize("config, message", [
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "lists templates \\['tool_use'\\] but none named"),
    ({"chat_template": 5}, "field 'chat_template' must be a string or a list"),
    ({"chat_template": "{% for %}"}, r"tokenizer_config.json: chat template: line 1: "),
    ({"chat_template": TEMPLATE, "bos_token": 5}, "field 'bos_token' must be a string or a token dict"),
])
def test_a_malformed_template_is_refused_at_load_naming_the_file(folder, tmp_path, config, message):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        mf.load_model(tmp_path, device="cpu")


def test_the_template_is_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError, match="chat template: .*unsafe"):
        template.render(CHATS[0])


@pytest.fixture(scope="module")
def demo():
    return mf.load_model("demo", device="cpu")


def test_the_demo_model_has_a_template_that_renders(demo):
    chat = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "add two numbers"}]
    text = demo.chat_template.render(chat)
    assert text == "<|bos|># system: Write Python.\n# user: add two numbers\n# assistant:\n"
    assert demo.chat_template.render(chat, add_generation_prompt=False).endswith("# user: add two numbers\n")
    completion = Engine(demo, max_model_len=128).generate(chat, GREEDY)[0].raise_for_error()
    assert list(completion.prompt_token_ids) == demo.tokenizer.encode(text, add_special_tokens=False).ids
    assert completion.prompt_token_ids.count(0) == 1 and completion.prompt_token_ids[0] == 0  # one BOS


def _run_cli(capsys, *args):
    status = cli.main(["generate", *args, "--device", "cpu", "--no-graphs"])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_chat_option_runs_in_process(demo, capsys):
    status, out, err = _run_cli(capsys, "--chat", "add two numbers", "--system", "Write Python.", "--temperature", "0",
                                "--max-tokens", "4", "--ignore-eos")
    assert status == 0, err
    text = demo.chat_template.render([{"role": "system", "content": "Write Python."},
                                      {"role": "user", "content": "add two numbers"}])
    prompt_tokens = len(demo.tokenizer.encode(text, add_special_tokens=False).ids)
    assert f"[prompt tokens {prompt_tokens}, generated tokens 4," in err
    ids = Engine(demo, max_model_len=128).generate(
        [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "add two numbers"}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids
    assert out == demo.tokenizer.decode(list(ids)) + "\n"  # the CLI ends the text with a newline


@pytest.mark.parametrize("args, message", [
    (["--system", "Write Python.", "hello"], "--system needs --chat"),
    (["--chat", "hi", "--model", "tiny"], "--chat: model tiny (a shape preset with random weights) has no chat "
                                          "template"),
])
def test_cli_chat_mistakes_are_one_error_line(capsys, args, message):
    status, out, err = _run_cli(capsys, *args)
    assert (status, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("args, message", [
    (["hello", "--chat", "hi"], "--chat: not allowed with argument prompt"),
    ([], "one of the arguments prompt --chat is required; see mla-func generate --help"),
])
def test_cli_takes_a_prompt_or_a_chat_not_both(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", *args])
    out, err = capsys.readouterr()
    assert (exited.value.code, out, err) == (2, "", f"error: {message}\n")
