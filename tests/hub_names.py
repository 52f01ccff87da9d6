"""Mixture-of-experts weights under the Hub's names, from a transformers 5 state dict."""


def expert_checkpoint_names(weights: dict, inter: int, names=("gate_proj", "up_proj", "down_proj"),
                            block: str = "mlp") -> dict:
    """transformers 5 fuses the experts on load (mlp.experts.gate_up_proj [E, 2I, D], gate rows
    first; mlp.experts.down_proj [E, D, I]); back to the Hub's per-expert gate, up and down
    `names` under `block` (".mlp." renamed), stacked over experts under a "*" name as
    models/mixtral.py and qwen3_moe.py read them. Works on numpy arrays and tensors."""
    gate, up, down = names
    out = {}
    for k, v in weights.items():
        p = k.replace(".mlp.", f".{block}.")
        if k.endswith("experts.gate_up_proj"):
            base = p[:-len("gate_up_proj")] + "*."
            out[f"{base}{gate}.weight"], out[f"{base}{up}.weight"] = v[:, :inter], v[:, inter:]
        elif k.endswith("experts.down_proj"):
            out[f"{p[:-len('down_proj')]}*.{down}.weight"] = v
        else:
            out[p] = v
    return out


def mixtral_checkpoint_names(weights: dict, inter: int) -> dict:
    """Mixtral's Hub names: `block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down."""
    return expert_checkpoint_names(weights, inter, ("w1", "w3", "w2"), "block_sparse_moe")
