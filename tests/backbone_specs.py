"""Random backbone configurations the backbone tests run over."""

from clefserve.testing.release import QWEN_DECAY_RATES, ReleaseSpec

L, F = "linear_attention", "full_attention"

# value/key head ratio 1 and 2; a layer count that is not a multiple of 4; more than one attention layer;
# both folder layouts; tied and untied output matrices; decays as strong as Qwen3.5's (a chunk's decay
# factors fall below the normal floats).
BACKBONE_SPECS = {
    "ratio2-6layers": ReleaseSpec(
        head=None, num_hidden_layers=6, linear_num_key_heads=2, linear_num_value_heads=4
    ),
    "ratio1-two-attn": ReleaseSpec(
        head=None,
        num_hidden_layers=7,
        layer_types=[L, F, L, L, F, L, L],
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.5,
        linear_conv_kernel_dim=3,
    ),
    "qwen-decays": ReleaseSpec(
        head=None, num_hidden_layers=4, linear_key_head_dim=32, linear_value_head_dim=32,
        decay_rates=QWEN_DECAY_RATES,
    ),
    "causal-lm-tied": ReleaseSpec(
        head=None,
        num_hidden_layers=5,
        hidden_size=48,
        intermediate_size=96,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=24,
        conditional_generation=False,
        tie_word_embeddings=True,
    ),
}
