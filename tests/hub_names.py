"""Mixtral's expert weights under the Hub's names, from a transformers 5 state dict."""


def mixtral_checkpoint_names(weights: dict, inter: int) -> dict:
    """transformers 5 fuses the experts on load (mlp.experts.gate_up_proj [E, 2I, D] = w1 then w3,
    mlp.experts.down_proj [E, D, I] = w2); back to the Hub's block_sparse_moe names, stacked over
    experts under a "*" name as models/mixtral.py reads them. Works on numpy arrays and tensors."""
    out = {}
    for k, v in weights.items():
        p = k.replace(".mlp.", ".block_sparse_moe.")
        if k.endswith("experts.gate_up_proj"):
            base = p[:-len("gate_up_proj")] + "*."
            out[base + "w1.weight"], out[base + "w3.weight"] = v[:, :inter], v[:, inter:]
        elif k.endswith("experts.down_proj"):
            out[p[:-len("down_proj")] + "*.w2.weight"] = v
        else:
            out[p] = v
    return out
