"""What the fixture generators (make_loader_fixtures.py, fixtures_compressed.py,
fixtures_peft.py) share: the tiny Qwen3-MoE they start from, saved by
transformers itself, and a checkpoint's tensors as a tree of nn.Linear
layers.  Imports torch and transformers when called (the by-hand producer
venv of make_loader_fixtures.py; never the test install)."""
from __future__ import annotations


def tiny_qwen3_moe(folder: str, H: int, I: int, E: int, k: int, seed: int) -> None:
    """A 1-layer Qwen3-MoE of random weights (bfloat16), ``save_pretrained`` to ``folder``, with a
    word-level tokenizer (mlx_lm.convert saves one)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(vocab_size=32, hidden_size=H, intermediate_size=2 * H, moe_intermediate_size=I,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2,
                            num_experts=E, num_experts_per_tok=k, norm_topk_prob=True, tie_word_embeddings=True)
    model = tf.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers initializes with std 0.02: a spread the block's output can show
        for n, p in model.named_parameters():
            if "mlp" in n:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(folder)


def linear_tree(path: str, pfx: str):
    """A torch module tree holding the checkpoint's tensors under ``pfx`` as bias-free
    nn.Linear layers at their checkpoint names (what compressed-tensors quantizes)."""
    import torch
    from safetensors.torch import load_file
    root = torch.nn.Module()
    for k, v in load_file(path).items():
        if not k.startswith(pfx):
            continue
        *names, _ = k.split(".")
        mod = root
        for i, p in enumerate(names):
            if not hasattr(mod, p):
                last = i == len(names) - 1
                mod.add_module(p, torch.nn.Linear(v.shape[1], v.shape[0], bias=False) if last else torch.nn.Module())
            mod = getattr(mod, p)
        mod.weight.data.copy_(v.float())
    return root
