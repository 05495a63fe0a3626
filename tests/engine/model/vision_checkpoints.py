"""Qwen3.5 checkpoints with a vision tower for the parity tests: tiny-vl and two random configs written by
transformers' save_pretrained (dense and MoE), and seeded test images of different sizes."""
from __future__ import annotations

import torch

from engine.model.tiny import perturb_parameters
from engine.multimodal.seeded_image import seeded_png

TEXT = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, eos_token_id=95)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              num_position_embeddings=36, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
TOKENS = dict(vision_start_token_id=90, vision_end_token_id=91, image_token_id=92, video_token_id=93)
VL_CONFIGS = {
    # Dense MLP, rotary over half the head: 8 frequencies, h and w own two each.
    "vl_dense": dict(text=dict(intermediate_size=80, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [4, 2, 2], "mrope_interleaved": True}), vision={}),
    # MoE MLP, a 3-block tower with a tanh-free GELU, h and w own three and two frequencies.
    "vl_moe": dict(text=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, rope_parameters={
                                 "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True}),
                   vision=dict(depth=3, hidden_act="gelu", num_position_embeddings=64)),
}


def build_vl_checkpoint(name: str, directory_factory):
    """(transformers model in float32, checkpoint directory) for tiny-vl or one of VL_CONFIGS."""
    import transformers

    if name == "tiny-vl":
        from engine.model.embedded import checkpoint_dir_of
        directory = checkpoint_dir_of("tiny-vl")
        hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
        return hf, directory
    spec = VL_CONFIGS[name]
    moe = "num_experts" in spec["text"]
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_class = (transformers.Qwen3_5MoeForConditionalGeneration if moe
                   else transformers.Qwen3_5ForConditionalGeneration)
    torch.manual_seed(0)
    config = config_class(text_config={**TEXT, **spec["text"]}, vision_config={**VISION, **spec["vision"]},
                          **TOKENS, tie_word_embeddings=False)
    hf = model_class(config).to(torch.float32).eval()
    perturb_parameters(hf, torch.Generator().manual_seed(21))
    directory = directory_factory(name)
    hf.save_pretrained(directory)
    return hf, directory


def png_bytes(height: int, width: int, seed: int) -> bytes:
    """A seeded RGB PNG (``engine/multimodal/seeded_image.py``)."""
    return seeded_png(height, width, seed)
