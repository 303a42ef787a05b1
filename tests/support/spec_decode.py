"""Speculative decoding references: a chi-square test of sampled tokens against exact
probabilities, and EAGLE / EAGLE-3 drafts computed in plain torch from a head's published
checkpoint tensors and a transformers target (the forward of EAGLE's own code and of vLLM's
llama_eagle.py / llama_eagle3.py, written out here without the engine's layers or cache)."""
from __future__ import annotations

import torch


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square test of `samples` (indices) against `probs` (every index has mass)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    df = probs.numel() - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2).item()


def _target_states(model, prompt: list[int], aux_layers: list[int] | None):
    """(the greedy next token, the final hidden states [T, h], and concat of the inputs of
    `aux_layers` [T, 3h] or None) of a transformers Llama over `prompt`."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    # hidden_states[i] is layer i's input for i < L; the last entry is after the final norm.
    states = out.hidden_states
    aux = None if aux_layers is None else torch.cat([states[i][0] for i in sorted(aux_layers)], dim=-1)
    return int(out.logits[0, -1].argmax()), states[-1][0], aux


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta):
    """Rotary embedding of x [T, heads, d] at positions 0..T-1 (rotate-half layout)."""
    d = x.shape[-1]
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] / theta ** (torch.arange(0, d, 2) / d)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def _attention(x, w, prefix, config):
    """Causal GQA self-attention of rows x (the q/k/v projections' input, biases where the
    checkpoint has them) with RoPE."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0)
    def project(name, count):
        return (x @ w[f"{prefix}{name}_proj.weight"].T + w.get(f"{prefix}{name}_proj.bias", 0)).view(len(x), count, d)
    q, k, v = _rope(project("q", heads), theta), _rope(project("k", kv_heads), theta), project("v", kv_heads)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), heads * d)
    return out @ w[f"{prefix}o_proj.weight"].T


def _mlp(x, w, prefix):
    gate, up = x @ w[f"{prefix}gate_proj.weight"].T, x @ w[f"{prefix}up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}down_proj.weight"].T


def eagle_drafts(target, w, config, prompt: list[int], k: int, start: int = 0) -> list[int]:
    """EAGLE: x = fc(concat(embedding of token p + 1, the target's final hidden state at p));
    out = x + attn(x) (no input norm), then + mlp(post norm); logits from the target's LM head on
    out, which is also the next step's hidden state. The head's sequence starts at prompt
    position `start` (a prefix-cache hit: the target computed no rows before it)."""
    token, final, _ = _target_states(target, prompt, None)
    eps, lm_head = config["rms_norm_eps"], target.lm_head.weight

    def rows(embeds, hidden):
        x = torch.cat([embeds, hidden], dim=-1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        x = x + _attention(x, w, "layers.0.self_attn.", config)
        out = x + _mlp(_rms(x, w["layers.0.post_attention_layernorm.weight"], eps), w, "layers.0.mlp.")
        return out, out
    return _chain(target.model.embed_tokens.weight, [*prompt[1:], token][start:], final[start:], k, rows,
                  lambda out: int((out @ lm_head.T).argmax()))


def eagle3_drafts(target, w, config, prompt: list[int], k: int, start: int = 0) -> list[int]:
    """EAGLE-3: h = fc(the target's three layers) (on later steps, the head's own output);
    attention over concat(input_layernorm(embedding), hidden_norm(h)) with h as the residual,
    then the MLP; logits from lm_head(norm(out)) over the draft vocabulary, draft token i being
    target token i + d2t[i]; the next step takes out before the norm. `start`: as `eagle_drafts`."""
    token, _, aux = _target_states(target, prompt, config["eagle_aux_hidden_state_layer_ids"])
    eps, p = config["rms_norm_eps"], "midlayer."

    def rows(embeds, hidden):
        x = torch.cat([_rms(embeds, w[f"{p}input_layernorm.weight"], eps),
                       _rms(hidden, w[f"{p}hidden_norm.weight"], eps)], dim=-1)
        x = hidden + _attention(x, w, f"{p}self_attn.", config)
        out = x + _mlp(_rms(x, w[f"{p}post_attention_layernorm.weight"], eps), w, f"{p}mlp.")
        return _rms(out, w["norm.weight"], eps), out

    def draft(normed):
        best = int((normed @ w["lm_head.weight"].T).argmax())
        return best + int(w["d2t"][best])
    return _chain(target.model.embed_tokens.weight, [*prompt[1:], token][start:], aux[start:] @ w["fc.weight"].T, k,
                  rows, draft)


def _chain(embed, tokens: list[int], hidden, k: int, rows, draft) -> list[int]:
    """k greedy drafts: head position p reads tokens[p] (the token after target position p) and
    hidden row p; each step recomputes the whole causal sequence and appends its draft and output."""
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            for_logits, out = rows(embed[torch.tensor(tokens)], hidden)
            drafts.append(draft(for_logits[-1]))
            tokens = [*tokens, drafts[-1]]
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


def tokens_and_stats(llm, prompts, params):
    """Each prompt's first sample's tokens and the scheduler's stats after them; the engine's ranks
    are shut down either way."""
    try:
        tokens = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, llm.engine.scheduler.make_stats()
    finally:
        llm.engine.executor.shutdown()
