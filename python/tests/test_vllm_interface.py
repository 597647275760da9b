"""CxlKvConnector against vLLM's connector interface, transcribed from upstream (vLLM cannot be
installed here). Update the transcription when upstream changes:

  vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/base.py
  at 003df2961dd8830c317a61f9745ccd557da9fa06 (KVConnectorBase_V1, SupportsHMA; vLLM 0.33)

Each entry: method name -> (parameters after self/cls in order, with defaults; what it returns).
"""
import inspect

from cxlkv.vllm import CxlKvConnector, CxlKvConnectorStats

EMPTY = inspect.Parameter.empty
VAR_KW = "**"

UPSTREAM = {
    "__init__": ([("vllm_config", EMPTY), ("role", EMPTY), ("kv_cache_config", EMPTY)], None),
    # worker side
    "bind_connector_metadata": ([("connector_metadata", EMPTY)], None),
    "clear_connector_metadata": ([], None),
    "register_kv_caches": ([("kv_caches", EMPTY)], None),
    "handle_preemptions": ([("kv_connector_metadata", EMPTY)], None),
    "start_load_kv": ([("forward_context", EMPTY), (VAR_KW, "kwargs")], None),
    "wait_for_layer_load": ([("layer_name", EMPTY)], None),
    "save_kv_layer": ([("layer_name", EMPTY), ("kv_layer", EMPTY), ("attn_metadata", EMPTY), (VAR_KW, "kwargs")],
                      None),
    "wait_for_save": ([], None),
    "get_finished": ([("finished_req_ids", EMPTY)], "tuple[set|None, set|None]"),
    "get_block_ids_with_load_errors": ([], "set[int]"),
    "shutdown": ([], None),
    "get_kv_connector_stats": ([], "KVConnectorStats|None"),
    # scheduler side
    "get_num_new_matched_tokens": ([("request", EMPTY), ("num_computed_tokens", EMPTY)], "tuple[int|None, bool]"),
    "update_state_after_alloc": ([("request", EMPTY), ("blocks", EMPTY), ("num_external_tokens", EMPTY)], None),
    "build_connector_meta": ([("scheduler_output", EMPTY)], "KVConnectorMetadata"),
    "request_finished": ([("request", EMPTY), ("block_ids", EMPTY)], "tuple[bool, dict|None]"),
    # SupportsHMA
    "request_finished_all_groups": ([("request", EMPTY), ("block_ids", EMPTY)], "tuple[bool, dict|None]"),
}
UPSTREAM_CLASSMETHODS = {
    "requires_piecewise_for_cudagraph": ([("extra_config", EMPTY)], "bool"),
    "build_kv_connector_stats": ([("data", None)], "KVConnectorStats|None"),
}
UPSTREAM_PROPERTIES = {"role", "requires_kv_delivery"}


def params(fn, skip_first=True):
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1 if skip_first else 0:]:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            out.append((VAR_KW, p.name))
        else:
            out.append((p.name, p.default))
    return out


def test_every_method_the_connector_implements_has_upstreams_signature():
    for name, (want, _) in UPSTREAM.items():
        fn = getattr(CxlKvConnector, name)
        got = params(fn)
        assert [n for n, _ in got] == [n for n, _ in want], f"{name}: {got} vs upstream {want}"
        for (n, ours), (_, theirs) in zip(got, want):
            # A default the connector adds to a parameter upstream requires keeps every call valid;
            # a default upstream has must be the same.
            assert theirs is EMPTY or ours == theirs, f"{name}({n}): default {ours!r}, upstream {theirs!r}"
    for name, (want, _) in UPSTREAM_CLASSMETHODS.items():
        raw = inspect.getattr_static(CxlKvConnector, name)
        assert isinstance(raw, classmethod), f"{name} must be a classmethod, as upstream"
        assert params(getattr(CxlKvConnector, name), skip_first=False) == want, name
    for name in UPSTREAM_PROPERTIES:
        assert isinstance(inspect.getattr_static(CxlKvConnector, name), property), name


def test_return_shapes_and_the_stats_object_vllm_aggregates():
    assert CxlKvConnector.requires_piecewise_for_cudagraph({}) is True
    assert CxlKvConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    stats = CxlKvConnector.build_kv_connector_stats({"loaded_blocks": 2})
    other = CxlKvConnectorStats({"loaded_blocks": 3, "save_errors": 1})
    merged = stats.aggregate(other).reduce()
    assert merged["loaded_blocks"] == 5 and merged["save_errors"] == 1
    assert not stats.is_empty()
    old = stats.clone_and_reset()
    assert stats.is_empty() and old.reduce()["loaded_blocks"] == 5
