"""The tapped hidden states follow Hugging Face's `hidden_states` convention, which the export's consumers use.

Tap i is `hidden_states[i + 1]` of the target's own forward; for the last layer that is the output after the final
norm (the reference DFlash code and every serving engine read it so), not the raw decoder-layer output.
"""

from __future__ import annotations

import torch

from dflash.target import Target, TargetConfig


def test_every_tap_including_the_last_layer_equals_hf_hidden_states() -> None:
    arch = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "vocab_size": 97}
    target = Target(TargetConfig(arch=arch, tap_layers=[2, 0, 1]), 1, torch.device("cpu"))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a right-padded row
    ours = target.hidden_states(ids, mask)
    with torch.no_grad():
        hf = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    h = 32
    for slot, layer in enumerate([2, 0, 1]):
        got = ours[..., slot * h:(slot + 1) * h]
        for row, n in ((0, 12), (1, 9)):  # real tokens only: padding positions are junk by contract
            torch.testing.assert_close(got[row, :n], hf[layer + 1][row, :n], rtol=1e-5, atol=1e-5)
    # the last layer's tap is really normalised (the raw layer output differs): the test would catch a regression
    raw = {}
    handle = target.layers[2].register_forward_hook(lambda _m, _i, out: raw.setdefault("x", out))
    try:
        target.hidden_states(ids, mask)
    finally:
        handle.remove()
    assert not torch.allclose(raw["x"][0], ours[0, :, :h], atol=1e-3)
