"""kvmesh's MTP layer against an independent implementation of DeepSeek-V4's MTP module.

The reference follows the public model code: DeepSeek's `inference/model.py` `MTPBlock.forward`
(`e = enorm(embed(ids)); x = hnorm(x); x = e_proj(e).unsqueeze(2) + h_proj(x); x = Block(x);
logits = head(x, hc_head_fn, hc_head_scale, hc_head_base, norm)`, the block being layer
`n_layers` of the config: compress ratio 0, so sliding-window attention, and a top-k (not
hash) MoE), and SGLang's `deepseek_v4_nextn.py` (the same, with the main model's streams
taken before its hc_head). The block itself is transformers' `DeepseekV4DecoderLayer`
(not kvmesh's), built as layer n of a config with one more sliding-window MoE layer, so the
tiny checkpoint stores it as the release does: `mtp.0.attn.*`, `mtp.0.ffn.*`,
`mtp.0.hc_attn_*`, ... beside `mtp.0.e_proj / h_proj / enorm / hnorm / norm / hc_head_*`.
Every MTP-only tensor (and every norm) is random, so swapping e/h, enorm/hnorm, the two
mHC heads or the main model's final norm for the layer's own would all show.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import TINY_BASE, TINY_CONFIGS, mtp_logits, random_prompt

NAME = "swa_csa_hca"
PROMPT = 21          # > 2 SWA windows (8), crosses CSA (4) and HCA (16) windows
TOL = 1e-4


def _config(extra_layer: bool) -> dict:
    cfg = {**TINY_BASE, **TINY_CONFIGS[NAME]}
    if extra_layer:     # the MTP block as layer n: sliding-window attention, top-k MoE
        cfg.update(num_hidden_layers=cfg["num_hidden_layers"] + 1,
                   layer_types=cfg["layer_types"] + ["sliding_attention"],
                   mlp_layer_types=cfg["mlp_layer_types"] + ["moe"])
    return cfg


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(checkpoint dir in the release's names with one MTP layer, transformers model of n + 1
    layers whose last layer is that MTP block, the MTP-only tensors)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from tests.quant_checkpoint import _upstream_name
    n = _config(False)["num_hidden_layers"]
    torch.manual_seed(0)
    ref = DeepseekV4ForCausalLM(DeepseekV4Config(**_config(True))).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("sinks", "e_score_correction_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):
                cfg = ref.config
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
    saved = tmp_path_factory.mktemp("ext")
    ref.save_pretrained(saved)
    c, hc = ref.config.hidden_size, ref.config.hc_mult
    mtp = {"e_proj.weight": torch.randn(c, c, generator=g) * 0.1, "h_proj.weight": torch.randn(c, c, generator=g) * 0.1,
           "enorm.weight": 1 + torch.randn(c, generator=g) * 0.2, "hnorm.weight": 1 + torch.randn(c, generator=g) * 0.2,
           "norm.weight": 1 + torch.randn(c, generator=g) * 0.2,
           "hc_head_fn": torch.randn(hc, hc * c, generator=g) * 0.05,
           "hc_head_base": torch.randn(hc, generator=g) * 0.1, "hc_head_scale": 1 + torch.randn(1, generator=g) * 0.2}
    state = {}
    for name, t in load_file(str(saved / "model.safetensors")).items():
        name = _upstream_name(name)
        state[f"mtp.0.{name.removeprefix(f'layers.{n}.')}" if name.startswith(f"layers.{n}.") else name] = t
    state.update({f"mtp.0.{k}": v for k, v in mtp.items()})
    out = tmp_path_factory.mktemp("mtp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    raw = json.loads((saved / "config.json").read_text())
    main = _config(False)
    raw.update(num_hidden_layers=n, layer_types=main["layer_types"], mlp_layer_types=main["mlp_layer_types"],
               num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(raw))
    return out, ref, mtp


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def reference_mtp_logits(ref, mtp: dict, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main streams [S, N, C] before the hc_head, MTP logits [S - 1, V]: row t from the streams
    at t and token t + 1, predicting token t + 2), written from DeepSeek's MTPBlock."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    cfg, body = ref.config, ref.model
    n, eps = cfg.num_hidden_layers - 1, cfg.rms_norm_eps
    captured = {}
    hook = body.layers[n - 1].register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
    with torch.no_grad():
        body(input_ids=torch.tensor([tokens]))                   # all layers run; keep the streams after n - 1
        hook.remove()
        h = captured["h"]                                         # [1, S, N, C]
        ids = torch.tensor([tokens[1:]])
        e = rms(body.embed_tokens(ids), mtp["enorm.weight"], eps)
        x = rms(h[:, :-1], mtp["hnorm.weight"], eps)
        x = F.linear(e, mtp["e_proj.weight"]).unsqueeze(2) + F.linear(x, mtp["h_proj.weight"])
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        emb = {t: body.rotary_emb(e, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=e, attention_mask=None, cache=None,
                                                 position_ids=pos, allow_is_causal_skip=False)
        x = body.layers[n](x, position_embeddings=emb, position_ids=pos, attention_mask=mask, input_ids=ids)
        flat = x.flatten(2).float()                                # DeepSeek's ParallelHead.hc_head
        mixes = F.linear(flat, mtp["hc_head_fn"]) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mixes * mtp["hc_head_scale"] + mtp["hc_head_base"]) + cfg.hc_eps
        y = (pre.unsqueeze(-1) * x).sum(2)
        logits = F.linear(rms(y, mtp["norm.weight"], eps), ref.lm_head.weight)
    return h[0], logits[0]


def test_mtp_layer_logits_match_an_independent_v4_mtp_implementation(models):
    path, ref, mtp = models
    tokens = random_prompt(PROMPT, seed=3)
    ref_streams, ref_logits = reference_mtp_logits(ref, mtp, tokens)
    streams, logits = mtp_logits(path, tokens)
    torch.testing.assert_close(streams, ref_streams, atol=TOL, rtol=TOL)
    assert logits.shape == ref_logits.shape == (PROMPT - 1, ref.config.vocab_size)
    torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=TOL)
    assert logits.std() > 100 * TOL           # not vacuous: the logits vary far beyond the tolerance


def test_mtp_layer_run_for_a_few_rows_gives_their_logits_and_writes_every_row_to_its_ring(models):
    """The drafter runs the layer past its K=V only for the rows it drafts from: their logits
    are those of the whole run, and the window ring is the same as after it."""
    from tests.helpers import mtp_logits
    path, _, _ = models
    tokens = random_prompt(PROMPT, seed=5)
    _, whole = mtp_logits(path, tokens)
    ring, every = mtp_logits(path, tokens, rows=list(range(PROMPT - 1)))
    torch.testing.assert_close(every, whole, atol=TOL, rtol=TOL)
    rows = [3, PROMPT - 2]
    some_ring, some = mtp_logits(path, tokens, rows=rows)
    torch.testing.assert_close(some, whole[rows], atol=TOL, rtol=TOL)
    assert torch.equal(some_ring, ring) and ring.abs().sum() > 0


def test_mtp_drafter_proposes_the_reference_argmax_from_the_main_streams_and_the_sampled_token(models):
    """After the prefill step the drafter's first draft is the reference MTP's argmax at the
    prompt's last position, fed the token the engine just sampled there."""
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.engine_config import EngineConfig
    from kvmesh.workers.sampling.params import SamplingParams
    path, ref, mtp = models
    tokens = random_prompt(PROMPT, seed=4)
    engine = Engine(EngineConfig(model=str(path), block_tokens=16, kv_cache_bytes=8 << 20, speculative_tokens=1))
    engine.add_request("r", tokens, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first = engine.step()[0].token_ids[0]
    seq = next(iter(engine.seqs.values()))
    draft = engine.speculator.drafter.propose(seq, 1)
    _, ref_logits = reference_mtp_logits(ref, mtp, tokens + [first])
    assert draft == [int(ref_logits[-1].argmax())]
