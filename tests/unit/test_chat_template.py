"""Chat templates (cluster/chat/template.py): the plain template's documented format, a
checkpoint's Jinja template; the V4 chat format: prompts render to the same token ids as transformers'
`apply_chat_template` on the same tokenizer files (BOS as the files say, system/user/assistant
turns, list content, the `thinking` switch via chat_template_kwargs), completions get BOS as
transformers' tokenizer adds it, and generation stops on the tokenizer's end-of-turn token."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvmesh.cluster.openai.protocol import ChatCompletionRequest
from kvmesh.cluster.chat.template import chat_prompt_ids, compiled_template, plain_chat_prompt, render_chat
from kvmesh.cluster.errors import APIError
from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
# DeepSeek-V4's encoding as a Jinja template: system prompt after BOS, <｜User｜> turns, earlier
# assistant turns with their reasoning dropped, and the generation prompt opening <think> in
# thinking mode or closing it (</think>) in chat mode.
V4_TEMPLATE = (
    "{%- if thinking is not defined %}{% set thinking = false %}{% endif -%}"
    "{{ bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor -%}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{ '<｜Assistant｜></think>' + m['content'] + eos_token }}"
    "{%- endif %}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{% endif -%}")
CORPUS = ["You are a helpful assistant.", "Hello, how are you today?", "I am fine, thanks!\n\nAnd you?",
          "Explain KV caches in one line.", "def f(x): return x * 2"] * 4


def write_tokenizer(path, *, add_bos=None, post_bos=False, template_file=True):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tok.save(str(path / "tokenizer.json"))
    bos = {"__type": "AddedToken", "content": BOS, "lstrip": False, "rstrip": False, "normalized": True,
           "single_word": False}                                   # the AddedToken form real configs use
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
           "eos_token": EOS}
    if add_bos is not None:
        cfg["add_bos_token"], cfg["add_eos_token"] = add_bos, False
    if template_file:
        (path / "chat_template.jinja").write_text(V4_TEMPLATE)
    else:
        cfg["chat_template"] = V4_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def kvmesh_chat_ids(path, messages, **kwargs):
    tok = load_tokenizer(path)
    body = ChatCompletionRequest.model_validate({"messages": messages, "chat_template_kwargs": kwargs or None})
    text = render_chat(tok.chat_template, [(m.role, m.text) for m in body.messages], body.add_generation_prompt,
                       **{**tok.special_tokens, **(body.chat_template_kwargs or {})})
    return tok.encode_rendered(text)


def hf_chat_ids(path, messages, **kwargs):
    from transformers import AutoTokenizer
    out = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs)
    return list(out)


CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello, how are you today?"}],
    "system_user": [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Explain KV caches in one line."}],
    "multi_turn": [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "I am fine, thanks!"},
                   {"role": "user", "content": "And you?\n\ndef f(x): return x * 2"}],
}


@pytest.mark.parametrize("template_file", [True, False])
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_chat_ids_equal_apply_chat_template(tmp_path, conversation, thinking, template_file):
    path = write_tokenizer(tmp_path, template_file=template_file)
    kwargs = {} if thinking is None else {"thinking": thinking}
    messages = CONVERSATIONS[conversation]
    ids = kvmesh_chat_ids(path, messages, **kwargs)
    assert ids == hf_chat_ids(path, messages, **kwargs)
    tok = load_tokenizer(path)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[-1] == tok._id("<think>" if thinking else "</think>")


def test_list_content_renders_like_the_same_text(tmp_path):
    path = write_tokenizer(tmp_path)
    as_list = [{"role": "system", "content": [{"type": "text", "text": "You are "},
                                              {"type": "text", "text": "a helpful assistant."}]},
               {"role": "user", "content": [{"type": "text", "text": "Hello, how are you today?"}]}]
    as_text = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "Hello, how are you today?"}]
    assert kvmesh_chat_ids(path, as_list, thinking=True) == hf_chat_ids(path, as_text, thinking=True)


@pytest.mark.parametrize("add_bos,post_bos", [(True, False), (False, True), (None, True), (None, False)])
def test_completion_prompts_get_bos_exactly_as_transformers_tokenizes_them(tmp_path, add_bos, post_bos):
    from transformers import AutoTokenizer
    path = write_tokenizer(tmp_path, add_bos=add_bos, post_bos=post_bos)
    text = "Hello, how are you today?"
    ids = load_tokenizer(path).encode(text)
    assert ids == AutoTokenizer.from_pretrained(str(path))(text)["input_ids"]
    assert (ids[0] == 0) == post_bos          # tokenizer.json's post-processor decides, as in transformers v5


def test_reserved_template_kwargs_are_a_bad_request():
    with pytest.raises(Exception, match="cannot be set through chat_template_kwargs"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "chat_template_kwargs": {"add_generation_prompt": False}})


def test_generation_stops_on_the_tokenizers_end_of_turn_token(tmp_path):
    from kvmesh.workers.sampling.params import SamplingParams
    ckpt = write_tiny_checkpoint(tmp_path / "m", "swa_csa_hca")
    prompt = random_prompt(20, seed=1)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    free = tiny_engine(ckpt, "swa_csa_hca").generate([prompt], params)[0]
    stop_at = next(i for i, t in enumerate(free.token_ids) if t not in free.token_ids[:i])  # first new token
    stop_at = max(stop_at, 2)
    eos_id = free.token_ids[stop_at]
    path = write_tokenizer(tmp_path / "m")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    eos_text = next(t for t, i in vocab.items() if i == eos_id)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": eos_text}))
    out = tiny_engine(ckpt, "swa_csa_hca").generate([prompt], params)[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(eos_id) + 1]
    assert out.finish_reason == "stop"


def test_end_of_turn_ids_are_the_tokenizers_eos_and_generation_configs(tmp_path):
    path = write_tokenizer(tmp_path)
    tok = load_tokenizer(path)
    assert tok.stop_token_ids == (tok.eos_id,) and tok.eos_id == 1
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert load_tokenizer(path).stop_token_ids == (1, 5)


def test_plain_chat_template_is_documented_format():
    assert plain_chat_prompt([("system", "be brief"), ("user", "hi")]) == \
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_checkpoint_chat_template_is_rendered_with_jinja():
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
    assert render_chat(template, [("user", "hi")]) == "[user]hi[bot]"
    with pytest.raises(ValueError):
        render_chat("{{ raise_exception('no system role') }}", [("system", "x")])


def test_a_template_is_compiled_once_and_renders_the_same_text():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}{{ bos_token }}|compile-once"
    before = compiled_template.cache_info()
    texts = [render_chat(template, [("user", "hé \"x\"")], bos_token="<s>") for _ in range(2)]
    after = compiled_template.cache_info()
    assert texts[0] == texts[1] == '<user>"hé \\"x\\""<s>|compile-once'
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    assert after.maxsize is not None                  # bounded


def test_a_cached_templates_raise_exception_is_still_the_same_400(tmp_path):
    path = write_tokenizer(tmp_path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    tok = load_tokenizer(path)
    ok = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    refused = ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "x"}]})
    assert chat_prompt_ids(tok, ok) == tok.encode_rendered("hi")
    for _ in range(2):                                    # compiled by the first render, then cached
        with pytest.raises(APIError) as e:
            chat_prompt_ids(tok, refused)
        assert (e.value.status, e.value.param, e.value.message) == \
            (400, "messages", "messages: the chat template refused them: no system role")
