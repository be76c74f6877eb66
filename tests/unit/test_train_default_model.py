"""scripts/train_default_model.py: reads its corpus from the installed package, trains a BPE
tokenizer and a V4 model whose vocabularies agree, grows both by V4's chat tokens and trains on
conversations kvmesh's encoder renders, is deterministic, and writes a checkpoint kvmesh's
engine serves in V4's chat format."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from scripts.default_chat_data import V4_TOKENS
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default_model.py"
SMOKE = ["--steps", "3", "--max-chars", "30000", "--seq-len", "64", "--batch", "2", "--vocab-size", "512",
         "--sample-tokens", "0", "--mtp-steps", "2", "--chat-steps", "3", "--chat-batch", "3"]


@pytest.fixture(scope="module")
def train_script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(train_script, tmp_path_factory) -> Path:
    return train_script.main([*SMOKE, "--out", str(tmp_path_factory.mktemp("trained"))])


def test_corpus_is_the_public_domain_web_bible_from_its_package(train_script):
    text = train_script.corpus_text(max_chars=200_000)
    assert text.startswith("In the beginning God created the heavens and the earth.")
    assert "`" not in text and len(text) == 200_000


def test_training_writes_a_checkpoint_whose_vocabularies_agree(trained):
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    tok = load_tokenizer(trained)
    config = json.loads((trained / "config.json").read_text())
    assert tok.vocab_size == config["vocab_size"] == 512 + len(V4_TOKENS)
    text = "Jesus wept, and the people saw it."
    assert tok.decode(tok.encode(text)) == text
    assert tok.chat_format == "dsv4"


def test_training_lowers_the_loss_and_saves_what_it_trained(train_script, tmp_path):
    text = train_script.corpus_text(max_chars=30_000)
    tok = train_script.train_tokenizer(text, 512)
    ids = torch.tensor(tok.encode(text).ids)
    model = train_script.build_model({**train_script.MODEL_CONFIG, "vocab_size": 512}, seed=0)
    losses = train_script.train(model, ids, steps=6, seq_len=64, batch=2, lr=3e-3, seed=0, log_every=0)
    assert losses[-1] < losses[0] - 0.5, losses
    # what is saved is what was trained: the reloaded checkpoint gives the same logits
    from transformers import DeepseekV4ForCausalLM
    train_script.save(model, tok, tmp_path)
    reloaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(ids[None, :200]).logits, reloaded(ids[None, :200]).logits)


def test_training_is_deterministic(train_script, trained, tmp_path):
    again = train_script.main([*SMOKE, "--out", str(tmp_path / "again")])
    for name in ("model.safetensors", "mtp.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (trained / name).read_bytes(), name


def test_engine_serves_the_trained_checkpoint(trained):
    engine = Engine(EngineConfig(model=str(trained), kv_cache_bytes=8 << 20))
    prompt = load_tokenizer(trained).encode("And God said,")
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and all(0 <= t < 512 + len(V4_TOKENS) for t in out.token_ids)


def test_mtp_stage_trains_the_mtp_layer_alone_and_kvmesh_serves_it_as_trained(train_script, trained, tmp_path):
    """Stage 2 leaves model.safetensors byte for byte, writes `mtp.*` in the release's names,
    lowers the MTP loss (token t + 2 from h_t and token t + 1), and kvmesh's MTP layer loaded
    from it computes the trained module's logits."""
    import shutil

    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    from tests.helpers import mtp_logits
    out = tmp_path / "ckpt"
    shutil.copytree(trained, out)
    (out / "mtp.safetensors").unlink()
    main_bytes = (out / "model.safetensors").read_bytes()
    model = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor(load_tokenizer(out).encode(train_script.corpus_text(max_chars=30_000)))
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    head, losses = train_script.train_mtp(model, ids, steps=8, seq_len=64, batch=2, lr=3e-3, seed=0, log_every=0)
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
    train_script.save_mtp(head, model, out)
    assert (out / "model.safetensors").read_bytes() == main_bytes
    names = set(load_file(str(out / "mtp.safetensors")))
    assert {f"mtp.0.{n}" for n in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
                                   "hc_head_fn", "hc_head_base", "hc_head_scale", "attn.wq_a.weight",
                                   "attn.attn_sink", "ffn.gate.weight", "hc_attn_fn")} <= names
    tokens = ids[:90].tolist()                    # > the sliding window (64)
    with torch.no_grad():
        want = head(model, train_script.main_streams(model, torch.tensor([tokens]))[0][:, :-1],
                    torch.tensor([tokens[1:]]))[0]
    _, got = mtp_logits(out, tokens, block_tokens=128)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mtp_self_distillation_resumes_from_the_written_layer_and_lowers_its_kl_to_the_main_model(
        train_script, trained):
    """`--mtp-resume`: a written MTP layer loads back exactly (`load_release` inverts
    `release_tensors`); `--mtp-target main` trains it toward the main model's own distribution
    over token t + 2 (what drafts are checked against), lowering KL(main || mtp)."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM
    model = DeepseekV4ForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    written = load_file(str(trained / "mtp.safetensors"))
    head = train_script.MTPHead(model, seed=1)
    head.load_release(model, written)
    assert all(torch.equal(v, written[k]) for k, v in head.release_tensors(model).items())
    window = torch.tensor([load_tokenizer(trained).encode(train_script.corpus_text(max_chars=3000))[:80]])

    def kl(h) -> float:
        streams, logits = train_script.main_streams(model, window)
        with torch.no_grad():
            mtp = h(model, streams[:, :-1], window[:, 1:])
        assert torch.equal(logits, model(window).logits)       # the main logits of that one forward
        return F.kl_div(F.log_softmax(mtp, -1), F.log_softmax(logits[:, 1:], -1), log_target=True,
                        reduction="batchmean").item()
    ids = torch.tensor(load_tokenizer(trained).encode(train_script.corpus_text(max_chars=30_000)))
    tuned, losses = train_script.train_mtp(model, ids, steps=8, seq_len=64, batch=2, lr=3e-3, seed=0,
                                           target="main", init=written, log_every=0)
    assert losses[-1] < losses[0] and kl(tuned) < kl(head) - 0.1, (losses, kl(tuned), kl(head))


def test_chat_stage_adds_v4s_tokens_as_new_rows_and_leaves_the_old_logits(train_script):
    """V4's tokens become single, not-special ids after the trained ones (as DeepSeek's
    tokenizers mark them); before any chat step, the grown model's logits over the old
    vocabulary are the old model's, for text of the old vocabulary."""
    text = train_script.corpus_text(max_chars=30_000)
    tok = train_script.train_tokenizer(text, 512)
    model = train_script.build_model({**train_script.MODEL_CONFIG, "vocab_size": 512}, seed=0).eval()
    ids = torch.tensor([tok.encode(text[:2000]).ids[:120]])
    with torch.no_grad():
        before = model(ids).logits
        grown = train_script.grow_vocab(model, tok, seed=0)
        after = grown(ids).logits
    assert [tok.token_to_id(t) for t in V4_TOKENS] == list(range(512, 512 + len(V4_TOKENS)))
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    assert all(not added[t].special and len(tok.encode(f"a{t}b").ids) == 3 for t in V4_TOKENS)
    assert after.shape[-1] == 512 + len(V4_TOKENS)
    torch.testing.assert_close(after[..., :512], before, atol=1e-5, rtol=1e-5)
    with pytest.raises(SystemExit, match="already has V4's tokens"):
        train_script.grow_vocab(grown, tok, seed=0)


def test_chat_batches_are_the_encoders_conversations_with_loss_on_the_replies_only(train_script):
    """Each conversation row is kvmesh's encoder's text; the labelled tokens are exactly the
    assistant turns after the prompt's mode token (reasoning, </think>, content, DSML calls, EOS)."""
    from kvmesh.cluster.chat.dsv4_encode import ASSISTANT, END_THINK, EOS
    text = train_script.corpus_text(max_chars=200_000)
    tok = train_script.train_tokenizer(text, 512)
    train_script.grow_vocab(train_script.build_model({**train_script.MODEL_CONFIG, "vocab_size": 512}, 0), tok, 0)
    rows = 0
    for step, (ids, labels) in zip(range(3), train_script.chat_batches(tok, text, batch=3, seed=0)):
        for row, lab in zip(ids.tolist(), labels.tolist()):
            rendered = tok.decode(row, skip_special_tokens=False)
            assert rendered.startswith("<｜begin▁of▁sentence｜>")
            replies = [r.split(EOS)[0] + EOS for r in rendered.split(ASSISTANT)[1:]]
            replies = [r.removeprefix("<think>").removeprefix(END_THINK) for r in replies]
            kept = [t if lab_t != -100 else None for t, lab_t in zip(row, lab)]
            spans = "".join(tok.decode([t], skip_special_tokens=False) if t is not None else "\0" for t in kept)
            assert [s for s in spans.split("\0") if s] == replies
            rows += 1
        if step == 2:                       # every third batch offers the tools and calls one
            assert any("<｜DSML｜invoke" in tok.decode(r, skip_special_tokens=False) for r in ids.tolist())
    assert rows == 3 + 3 + 1
