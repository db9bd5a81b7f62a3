"""FSDP2's units: which decoder layers share one all-gather and one reduce-scatter (torch-free, so the memory
plan counts the same units the training engine builds)."""


def fsdp_units(layer_params: list[int], min_params: int) -> list[range]:
    """FSDP2's units over the decoder layers, given each layer's parameter count: consecutive layers grouped in
    order until a group holds at least `min_params` (each group one all-gather and one reduce-scatter per pass
    instead of one per layer); layers after the last full group are left to the root unit with the embedding and
    the head. `min_params` 0: a unit per layer; a model whose layers hold fewer in all is one unit, the root."""
    units: list[range] = []
    start = held = 0
    for i, n in enumerate(layer_params):
        held += n
        if held >= min_params:
            units.append(range(start, i + 1))
            start, held = i + 1, 0
    return units
