"""Random Kimi Linear checkpoints written by transformers' save_pretrained (the oracle), and tiny-kimi."""
from __future__ import annotations

import torch

from engine.model.tiny import perturb_parameters

KIMI_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                 routed_scaling_factor=2.446, pad_token_id=None, bos_token_id=None, eos_token_id=95,
                 linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                     "full_attn_layers": [2, 4], "kda_layers": [1, 3]},
                 first_k_dense_replace=1)
KIMI_CONFIGS = {
    # Low-rank queries with biases, MLA first, two dense MLPs, 2 heads and other ranks.
    "kimi_qlora": dict(num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24,
                       attention_bias=True, kv_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=20,
                       first_k_dense_replace=2,
                       linear_attn_config={"head_dim": 8, "num_heads": 6, "short_conv_kernel_size": 3,
                                           "full_attn_layers": [1, 4], "kda_layers": [2, 3, 5]}),
    # Grouped routing (4 groups, 2 kept), 3 experts per token, 2 shared experts, 8 heads.
    "kimi_grouped": dict(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=8, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, num_local_experts=16, num_experts_per_tok=3, n_group=4,
                         topk_group=2, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5),
    # Mostly MLA (3 of 4 layers), every MLP sparse, one expert per token.
    "kimi_mla_heavy": dict(first_k_dense_replace=0, num_experts_per_tok=1, kv_lora_rank=32, qk_rope_head_dim=16,
                           linear_attn_config={"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
                                               "full_attn_layers": [1, 2, 4], "kda_layers": [3]}),
}


def randomize_kimi(model: torch.nn.Module, seed: int) -> None:
    """Perturb every parameter and the router's score-correction bias (HF inits it to zeros)."""
    generator = torch.Generator().manual_seed(seed)
    perturb_parameters(model, generator)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))


def build_kimi_checkpoint(name: str, directory_factory):
    """(transformers model in float32, checkpoint directory) for tiny-kimi or one of KIMI_CONFIGS."""
    import transformers

    if name == "tiny-kimi":
        from engine.model.embedded import checkpoint_dir_of
        directory = checkpoint_dir_of("tiny-kimi")
        hf = transformers.KimiLinearForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        return hf, directory
    torch.manual_seed(0)
    config = transformers.KimiLinearConfig(**{**KIMI_BASE, **KIMI_CONFIGS[name]}, dtype="float32")
    hf = transformers.KimiLinearForCausalLM(config).to(torch.float32).eval()
    randomize_kimi(hf, 11)
    directory = directory_factory(name)
    hf.save_pretrained(directory)
    return hf, directory
