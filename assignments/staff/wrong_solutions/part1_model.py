"""Wrong solutions for Part 1 (the model): plausible mistakes the graded tests must catch (staff only).

Each entry is a small patch of one problem's solution code. Applied alone, it must make that
problem's graded tests lose points (the other problems are graded with the reference code).
"""

LAYERS = "cs336_inference/layers.py"
ATTENTION = "cs336_inference/attention.py"
MODEL = "cs336_inference/model.py"

WRONG = [
    # ------------------------------------------------------------------------------------- rmsnorm
    dict(
        problem="rmsnorm",
        name="no_float32_upcast",
        mistake="normalises in the input dtype, so fp16 activations of a few hundred overflow x^2 (output 0)",
        file=LAYERS,
        find="x32 = x.float()",
        replace="x32 = x",
    ),
    dict(
        problem="rmsnorm",
        name="eps_outside_the_root",
        mistake="divides by sqrt(mean(x^2)) + eps instead of sqrt(mean(x^2) + eps)",
        file=LAYERS,
        find="x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)",
        replace="x32 = x32 / (x32.pow(2).mean(dim=-1, keepdim=True).sqrt() + self.eps)",
    ),
    dict(
        problem="rmsnorm",
        name="no_gain",
        mistake="forgets the learned gain g (self.weight)",
        file=LAYERS,
        find="return self.weight * x32.to(dtype)",
        replace="return x32.to(dtype)",
    ),
    dict(
        problem="rmsnorm",
        name="no_cast_back",
        mistake="returns the float32 result: an fp16 model's activations silently become float32",
        file=LAYERS,
        find="return self.weight * x32.to(dtype)",
        replace="return self.weight * x32",
    ),
    dict(
        problem="rmsnorm",
        name="mean_over_all_dims",
        mistake="takes the mean of squares over the whole tensor instead of each vector's last dimension",
        file=LAYERS,
        find="x32.pow(2).mean(dim=-1, keepdim=True)",
        replace="x32.pow(2).mean()",
    ),
    # ---------------------------------------------------------------------------------------- rope
    dict(
        problem="rope",
        name="rotate_half_sign",
        mistake="rotate_half returns (x2, -x1) instead of (-x2, x1): every pair rotates the wrong way",
        file=LAYERS,
        find="return torch.cat([-x2, x1], dim=-1)",
        replace="return torch.cat([x2, -x1], dim=-1)",
    ),
    dict(
        problem="rope",
        name="interleaved_pairs",
        mistake="rotates interleaved pairs (x_2i, x_2i+1) (the paper's layout) instead of (x_i, x_i+H/2)",
        file=LAYERS,
        find="x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat([-x2, x1], dim=-1)",
        replace="x1, x2 = x[..., 0::2], x[..., 1::2]\n    return torch.stack([-x2, x1], dim=-1).flatten(-2)",
    ),
    dict(
        problem="rope",
        name="minus_sin",
        mistake="x cos - rotate_half(x) sin: rotates by minus the angle",
        file=LAYERS,
        find="return x * cos + rotate_half(x) * sin",
        replace="return x * cos - rotate_half(x) * sin",
    ),
    dict(
        problem="rope",
        name="cos_sin_swapped",
        mistake="x sin + rotate_half(x) cos: cos and sin swapped",
        file=LAYERS,
        find="return x * cos + rotate_half(x) * sin",
        replace="return x * sin + rotate_half(x) * cos",
    ),
    dict(
        problem="rope",
        name="float32_tables_upcast",
        mistake="multiplies by the float32 tables without casting them: bf16 queries come back float32",
        file=LAYERS,
        find="cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)",
        replace="cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)",
    ),
    # -------------------------------------------------------------------------------------- swiglu
    dict(
        problem="swiglu",
        name="silu_on_up",
        mistake="applies silu to the up projection instead of the gate",
        file=LAYERS,
        find="return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))",
        replace="return self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))",
    ),
    dict(
        problem="swiglu",
        name="gelu",
        mistake="uses gelu (GeGLU) instead of silu",
        file=LAYERS,
        find="return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))",
        replace="return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))",
    ),
    dict(
        problem="swiglu",
        name="sigmoid_gate",
        mistake="uses sigmoid(gate) (the original GLU) instead of silu(gate) = gate * sigmoid(gate)",
        file=LAYERS,
        find="return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))",
        replace="return self.down_proj(torch.sigmoid(self.gate_proj(x)) * self.up_proj(x))",
    ),
    dict(
        problem="swiglu",
        name="no_up_projection",
        mistake="forgets the up projection: down(silu(gate x))",
        file=LAYERS,
        find="return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))",
        replace="return self.down_proj(F.silu(self.gate_proj(x)))",
    ),
    # ----------------------------------------------------------------------------------- attention
    dict(
        problem="attention",
        name="mask_sees_next_token",
        mistake="causal mask j <= i + 1: each query also sees the next token",
        file=ATTENTION,
        find="return (k <= q) & (k >= 0)",
        replace="return (k <= q + 1) & (k >= 0)",
    ),
    dict(
        problem="attention",
        name="mask_hides_current_token",
        mistake="causal mask j < i: a query does not see its own key (the first row is empty)",
        file=ATTENTION,
        find="return (k <= q) & (k >= 0)",
        replace="return (k < q) & (k >= 0)",
    ),
    dict(
        problem="attention",
        name="empty_slots_visible",
        mistake="forgets that step -1 marks an empty cache slot: empty slots are attended to",
        file=ATTENTION,
        find="return (k <= q) & (k >= 0)",
        replace="return k <= q",
    ),
    dict(
        problem="attention",
        name="divides_by_scale",
        mistake="divides the scores by scale (= 1/sqrt(H)) instead of multiplying",
        file=ATTENTION,
        find='scores = torch.einsum("bkgth,bksh->bkgts", qg, k) * scale',
        replace='scores = torch.einsum("bkgth,bksh->bkgts", qg, k) / scale',
    ),
    dict(
        problem="attention",
        name="no_scale",
        mistake="forgets the 1/sqrt(H) scale",
        file=ATTENTION,
        find='scores = torch.einsum("bkgth,bksh->bkgts", qg, k) * scale',
        replace='scores = torch.einsum("bkgth,bksh->bkgts", qg, k)',
    ),
    dict(
        problem="attention",
        name="repeats_kv",
        mistake="copies K and V N/K times (repeat_interleave) instead of grouping the query heads",
        file=ATTENTION,
        find="    K = k.shape[1]\n    qg = ",
        replace=(
            "    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)\n"
            "    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)\n"
            "    K = k.shape[1]\n    qg = "
        ),
    ),
    dict(
        problem="attention",
        name="heads_grouped_round_robin",
        mistake="query head n uses K/V head n % K instead of n // (N/K) (heads split as (g k), not (k g))",
        file=ATTENTION,
        edits=[
            (
                'rearrange(q, "b (k g) t h -> b k g t h", k=K)',
                'rearrange(q, "b (g k) t h -> b k g t h", k=K)',
            ),
            ('rearrange(out, "b k g t h -> b (k g) t h")', 'rearrange(out, "b k g t h -> b (g k) t h")'),
        ],
    ),
    dict(
        problem="attention",
        name="softmax_over_queries",
        mistake="softmax over the query dimension instead of the keys",
        file=ATTENTION,
        find="probs = scores.float().softmax(dim=-1).to(v.dtype)",
        replace="probs = scores.float().softmax(dim=-2).to(v.dtype)",
    ),
    dict(
        problem="attention",
        name="mask_broadcast_over_kv_heads",
        mistake="mask[:, None] against [B, K, G, T, S] scores: row b's mask lands on K/V head b",
        file=ATTENTION,
        find='scores = scores.masked_fill(~mask[:, None, None], float("-inf"))',
        replace='scores = scores.masked_fill(~mask[:, None], float("-inf"))',
    ),
    dict(
        problem="attention",
        name="mask_multiplies_scores",
        mistake="masks by zeroing the scores (score 0 is still a weight of exp(0)) instead of -inf",
        file=ATTENTION,
        find='scores = scores.masked_fill(~mask[:, None, None], float("-inf"))',
        replace="scores = scores * mask[:, None, None]",
    ),
    # ------------------------------------------------------------------------------ sliding_window
    dict(
        problem="sliding_window",
        name="window_one_too_wide",
        mistake="i - W <= j: the window does not count the current token (W + 1 keys)",
        file=ATTENTION,
        find="return k > q - window",
        replace="return k >= q - window",
    ),
    dict(
        problem="sliding_window",
        name="window_one_too_narrow",
        mistake="i - W + 1 < j: only W - 1 keys",
        file=ATTENTION,
        find="return k > q - window",
        replace="return k > q - window + 1",
    ),
    dict(
        problem="sliding_window",
        name="window_inverted",
        mistake="returns the keys outside the window (True = masked out, another library's convention)",
        file=ATTENTION,
        find="return k > q - window",
        replace="return k <= q - window",
    ),
    dict(
        problem="sliding_window",
        name="window_from_the_start",
        mistake="keeps the first W steps of the sequence instead of the last W before each query",
        file=ATTENTION,
        find="return k > q - window",
        replace="return k < window",
    ),
    # ----------------------------------------------------------------------------------------- cla
    dict(
        problem="cla",
        name="borrows_previous_layer",
        mistake="borrows K/V from layer - 1 instead of the group's owner (right only for kv_share = 2)",
        file=ATTENTION,
        find="k, v, steps = ctx.kv[self.owner]",
        replace="k, v, steps = ctx.kv[self.layer - 1]",
    ),
    dict(
        problem="cla",
        name="groups_of_two",
        mistake="assumes groups of two layers (owner = layer - layer % 2) whatever kv_share is",
        file=ATTENTION,
        find="k, v, steps = ctx.kv[self.owner]",
        replace="k, v, steps = ctx.kv[self.layer - self.layer % 2]",
    ),
    dict(
        problem="cla",
        name="borrows_layer_zero",
        mistake="every borrower reads layer 0's K/V",
        file=ATTENTION,
        find="k, v, steps = ctx.kv[self.owner]",
        replace="k, v, steps = ctx.kv[0]",
    ),
    dict(
        problem="cla",
        name="borrows_kv_without_steps",
        mistake="borrows k and v but takes the query steps as key steps (wrong once a cache holds more)",
        file=ATTENTION,
        find="k, v, steps = ctx.kv[self.owner]",
        replace="k, v, _ = ctx.kv[self.owner]\n        steps = ctx.q_steps",
    ),
    # ----------------------------------------------------------------------------------------- mla
    dict(
        problem="mla",
        name="absorbed_without_rope_scores",
        mistake="the absorbed path scores only the latent part and forgets q_pe . k_pe",
        file=ATTENTION,
        find=(
            'scores = torch.einsum("bntr,bsr->bnts", q_latent, c_kv) + torch.einsum("bntp,bsp->bnts", q_pe, k_pe)'
        ),
        replace='scores = torch.einsum("bntr,bsr->bnts", q_latent, c_kv)',
    ),
    dict(
        problem="mla",
        name="absorbed_without_scale",
        mistake="the absorbed path forgets the 1/sqrt(nope + rope dims) scale",
        file=ATTENTION,
        find="        scores = scores * self.scale\n",
        replace="",
    ),
    dict(
        problem="mla",
        name="absorbed_without_mask",
        mistake="the absorbed path ignores the mask (fine for one decode token, wrong for T > 1 or padding)",
        file=ATTENTION,
        find='        if mask is not None:\n            scores = scores.masked_fill(~mask[:, None], float("-inf"))\n',
        replace="",
    ),
    dict(
        problem="mla",
        name="absorbed_builds_per_head_kv",
        mistake="the right numbers at the wrong cost: the 'absorbed' path multiplies the cached latents by "
        "W_UK and W_UV itself, building every head's keys and values for every cached step (what absorption "
        "exists to avoid), without calling kv_b_proj",
        file=ATTENTION,
        edits=[
            (
                '        q_latent = torch.einsum("bntd,ndr->bntr", q_nope, w_uk)\n'
                '        scores = torch.einsum("bntr,bsr->bnts", q_latent, c_kv) + torch.einsum("bntp,bsp->bnts", q_pe, k_pe)\n',
                '        k_nope = torch.einsum("bsr,ndr->bnsd", c_kv, w_uk)\n'
                '        scores = torch.einsum("bntd,bnsd->bnts", q_nope, k_nope) + torch.einsum("bntp,bsp->bnts", q_pe, k_pe)\n',
            ),
            (
                '        out_latent = torch.einsum("bnts,bsr->bntr", probs, c_kv)\n'
                '        return torch.einsum("bntr,nvr->bntv", out_latent, w_uv)\n',
                '        v = torch.einsum("bsr,nvr->bnsv", c_kv, w_uv)\n'
                '        return torch.einsum("bnts,bnsv->bntv", probs, v)\n',
            ),
        ],
    ),
    dict(
        problem="mla",
        name="naive_heads_minor",
        mistake="splits kv_b_proj's output as (d n) instead of (n d): head and feature indices mixed up",
        file=ATTENTION,
        find='kv = rearrange(self.kv_b_proj(c_kv), "b s (n d) -> b n s d", n=self.n_heads)',
        replace='kv = rearrange(self.kv_b_proj(c_kv), "b s (d n) -> b n s d", n=self.n_heads)',
    ),
    dict(
        problem="mla",
        name="naive_query_parts_swapped",
        mistake="builds the query as [q_pe, q_nope] while the key is [k_nope, k_pe]",
        file=ATTENTION,
        find="q = torch.cat([q_nope, q_pe], dim=-1)",
        replace="q = torch.cat([q_pe, q_nope], dim=-1)",
    ),
    # ------------------------------------------------------------------------------ transformer_lm
    dict(
        problem="transformer_lm",
        name="post_norm",
        mistake="post-norm blocks (norm after the residual add, as in the original transformer)",
        file=MODEL,
        find="x = x + self.attn(self.attn_norm(x), ctx)\n        return x + self.mlp(self.mlp_norm(x))",
        replace="x = self.attn_norm(x + self.attn(x, ctx))\n        return self.mlp_norm(x + self.mlp(x))",
    ),
    dict(
        problem="transformer_lm",
        name="no_final_norm",
        mistake="forgets the final norm before the vocabulary projection",
        file=MODEL,
        find="h = self.norm(x)\n        logits = F.linear(h, self.vocab_weight)",
        replace="h = x\n        logits = F.linear(h, self.vocab_weight)",
    ),
    dict(
        problem="transformer_lm",
        name="always_tied",
        mistake="always projects with the embedding matrix, also when the checkpoint has its own lm_head",
        file=MODEL,
        find="logits = F.linear(h, self.vocab_weight)",
        replace="logits = F.linear(h, self.embed.weight)",
    ),
    dict(
        problem="transformer_lm",
        name="parallel_block",
        mistake="attention and MLP both read the block input (GPT-J's parallel block) instead of in sequence",
        file=MODEL,
        find="x = x + self.attn(self.attn_norm(x), ctx)\n        return x + self.mlp(self.mlp_norm(x))",
        replace="return x + self.attn(self.attn_norm(x), ctx) + self.mlp(self.mlp_norm(x))",
    ),
    dict(
        problem="transformer_lm",
        name="one_norm_for_both",
        mistake="uses mlp_norm before attention too (one norm's weights for both branches)",
        file=MODEL,
        find="x = x + self.attn(self.attn_norm(x), ctx)",
        replace="x = x + self.attn(self.mlp_norm(x), ctx)",
    ),
    dict(
        problem="transformer_lm",
        name="no_mlp_residual",
        mistake="forgets the residual connection around the MLP",
        file=MODEL,
        find="return x + self.mlp(self.mlp_norm(x))",
        replace="return self.mlp(self.mlp_norm(x))",
    ),
]
