"""Compatibility descriptor, peer metadata encoding and the notification format."""

import base64
import json

import pytest
import torch

from kvtransfer import (
    IncompatiblePeerError,
    KVCompat,
    MetadataError,
    PeerMetadata,
    PoolError,
    check_compatible,
)
from kvtransfer.compat import window_layers
from kvtransfer.protocol import HELLO, BatchNotice, decode

pytestmark = pytest.mark.timeout(30)

DEFAULT = KVCompat(
    "smollm2-135m", "float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64
)


def meta(**overrides) -> PeerMetadata:
    fields = dict(
        agent_name="decode-0",
        backend="nixl",
        compat=DEFAULT,
        num_blocks=100,
        base_addr=0x7F0000000000,
        mem_type="DRAM",
        device_id=0,
        agent_metadata=b"\x00\x01blob\xff",
    )
    fields.update(overrides)
    return PeerMetadata(**fields)


def test_default_model_block_bytes():
    assert DEFAULT.block_bytes == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert DEFAULT.block_shape == (3, 30, 2, 16, 64)  # heads first


def test_hash_is_stable_and_covers_every_field():
    assert DEFAULT.hash() == KVCompat(**DEFAULT.to_dict()).hash()
    variants = [
        KVCompat("other-model", "float32", 16, 30, 3, 64),
        KVCompat("smollm2-135m", "bfloat16", 16, 30, 3, 64),
        KVCompat("smollm2-135m", "float32", 32, 30, 3, 64),
        KVCompat("smollm2-135m", "float32", 16, 29, 3, 64),
        KVCompat("smollm2-135m", "float32", 16, 30, 6, 32),
        KVCompat("smollm2-135m", "float32", 16, 30, 3, 64, layout="layer-major"),
    ]
    hashes = {v.hash() for v in variants} | {DEFAULT.hash()}
    assert len(hashes) == len(variants) + 1


def test_dtype_is_normalized():
    assert KVCompat("m", torch.bfloat16, 16, 1, 1, 8).dtype == "bfloat16"
    assert KVCompat("m", "torch.float16", 16, 1, 1, 8) == KVCompat("m", "float16", 16, 1, 1, 8)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVCompat("m", "complex64", 16, 1, 1, 8)


def test_check_compatible_names_the_differing_fields():
    check_compatible(DEFAULT, KVCompat(**DEFAULT.to_dict()))
    other = KVCompat("smollm2-135m", "bfloat16", 32, 30, 3, 64)
    with pytest.raises(IncompatiblePeerError, match="dtype.*block_size") as e:
        check_compatible(DEFAULT, other, peer="'prefill-1'")
    assert "prefill-1" in str(e.value) and "model_id" not in str(e.value)


def test_for_pool_and_check_pool():
    pool = torch.zeros(5, 3, 2, 2, 16, 8)
    compat = KVCompat.for_pool(pool, "m")
    assert compat.block_shape == (3, 2, 2, 16, 8) and compat.dtype == "float32"
    assert (compat.num_kv_heads, compat.num_layers, compat.block_size) == (3, 2, 16)
    compat.check_pool(pool)
    with pytest.raises(PoolError, match="shape"):
        compat.check_pool(torch.zeros(5, 3, 2, 2, 8, 8))
    with pytest.raises(PoolError, match="shape"):  # the layout before heads came first
        compat.check_pool(torch.zeros(5, 2, 2, 16, 3, 8))
    with pytest.raises(PoolError, match="dtype"):
        compat.check_pool(pool.half())
    with pytest.raises(PoolError, match="contiguous"):
        compat.check_pool(pool.transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(PoolError, match="num_blocks, num_kv_heads, num_layers, 2"):
        KVCompat.for_pool(torch.zeros(5, 3, 2, 3, 16, 8), "m")


def test_metadata_roundtrip():
    m = meta()
    data = m.to_bytes()
    assert PeerMetadata.from_bytes(data) == m
    assert json.loads(data)["compat_hash"] == DEFAULT.hash()


def _mutated(**changes) -> bytes:
    doc = json.loads(meta().to_bytes())
    for key, value in changes.items():
        if value is KeyError:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (_mutated(version=2), "version 2"),
        (_mutated(agent_name=KeyError), "missing field 'agent_name'"),
        (_mutated(num_blocks="100"), "'num_blocks' must be int"),
        (_mutated(num_blocks=True), "'num_blocks' must be int"),
        (_mutated(num_blocks=0), "num_blocks=0"),
        (_mutated(base_addr=-1), "base_addr"),
        (_mutated(base_addr=2**64 - 10), "base_addr"),
        (_mutated(mem_type="HBM"), "mem_type"),
        (_mutated(agent_metadata="not base64!"), "base64"),
        (_mutated(compat_hash="0" * 64), "compat_hash does not match"),
        (_mutated(compat={"model_id": "m"}), "missing"),
        (_mutated(compat=dict(DEFAULT.to_dict(), block_size=-16)), "block_size"),
        (meta().to_bytes()[:40], "not valid JSON"),
    ],
)
def test_malformed_metadata_is_a_clear_error(data, message):
    with pytest.raises(MetadataError, match=message):
        PeerMetadata.from_bytes(data)


def test_metadata_rejects_non_bytes():
    with pytest.raises(MetadataError, match="must be bytes"):
        PeerMetadata.from_bytes("text")  # type: ignore[arg-type]


def test_notice_roundtrip_and_malformed():
    n = BatchNotice("req-1", 3, (5, 7, 9), total=12)
    assert decode(n.encode()) == n and n.final
    assert decode(BatchNotice("r", 0, ()).encode()).total is None
    assert decode(HELLO) is None
    for bad in [
        b"hello",
        b"pdkv1:{",
        b"pdkv1:[]",
        b'pdkv1:{"r":1,"s":0,"b":[]}',
        b'pdkv1:{"r":"x","s":0,"b":[1.5]}',
        b'pdkv1:{"r":"x","s":0,"b":[],"n":"3"}',
    ]:
        with pytest.raises(ValueError):
            decode(bad)


def test_agent_blob_survives_base64():
    blob = bytes(range(256)) * 3
    m = PeerMetadata.from_bytes(meta(agent_metadata=blob).to_bytes())
    assert m.agent_metadata == blob
    assert base64.b64decode(json.loads(meta(agent_metadata=blob).to_bytes())["agent_metadata"])


def test_package_import_is_light():
    """The router reads compat hashes and metadata: importing kvtransfer pulls no torch/NIXL."""
    import subprocess
    import sys

    code = (
        "import sys, kvtransfer; kvtransfer.PeerMetadata; kvtransfer.KVCompat; "
        "assert not {'torch', 'nixl', 'numpy'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- quantized KV caches (vLLM's kv_cache_dtype, engine/kv/kv_format.py) -------------------------


def test_quantized_pools_are_described_by_format_with_the_model_head_dim():
    fp8 = KVCompat.for_pool(torch.zeros(4, 3, 30, 2, 16, 64, dtype=torch.float8_e4m3fn), "m", "fp8")
    assert (fp8.kv_cache_dtype, fp8.dtype, fp8.head_dim, fp8.scale_layout) == (
        "fp8_e4m3",
        "float8_e4m3fn",
        64,
        "unit",
    )
    assert fp8.block_bytes == 30 * 2 * 16 * 3 * 64 == DEFAULT.block_bytes // 4
    e5m2 = KVCompat.for_pool(
        torch.zeros(4, 3, 30, 2, 16, 64, dtype=torch.float8_e5m2), "m", "fp8_e5m2"
    )
    assert e5m2.dtype == "float8_e5m2" and e5m2.block_bytes == fp8.block_bytes
    # int8: 64 values + a float32 scale (4 int8 elements) per token and kv head
    int8_pool = torch.zeros(4, 3, 30, 2, 16, 68, dtype=torch.int8)
    int8 = KVCompat.for_pool(int8_pool, "m", "int8")
    assert (int8.head_dim, int8.stored_head_dim, int8.block_shape) == (64, 68, (3, 30, 2, 16, 68))
    assert int8.block_bytes == 30 * 2 * 16 * 3 * 68
    assert int8.scale_layout == "per-token-head:float32-after-head_dim"
    int8.check_pool(int8_pool)
    assert len({c.hash() for c in (DEFAULT, fp8, e5m2, int8)}) == 4
    assert KVCompat.from_dict(int8.to_dict()) == int8


def test_a_pool_that_is_not_of_its_declared_format_is_refused():
    with pytest.raises(
        PoolError, match="not a int8 KV cache"
    ):  # the engine said int8, pool is fp32
        KVCompat.for_pool(torch.zeros(4, 3, 2, 2, 16, 68), "m", "int8")
    with pytest.raises(PoolError, match="auto KV cache"):  # an fp8 pool described as auto
        KVCompat.for_pool(torch.zeros(4, 3, 2, 2, 16, 64, dtype=torch.float8_e4m3fn), "m")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        KVCompat("m", "int8", 16, 2, 3, 64, kv_cache_dtype="int4")
    foreign = KVCompat("m", "int8", 16, 2, 3, 64, kv_cache_dtype="int8", scale_layout="per-block")
    with pytest.raises(
        PoolError, match="scale layout 'per-block'"
    ):  # a peer may say it; we never store it
        foreign.check_pool(torch.zeros(4, 3, 2, 2, 16, 68, dtype=torch.int8))


def test_different_kv_formats_are_refused_naming_both():
    fp8 = KVCompat("m", "float8_e4m3fn", 16, 30, 3, 64, kv_cache_dtype="fp8")
    int8 = KVCompat("m", "int8", 16, 30, 3, 64, kv_cache_dtype="int8")
    with pytest.raises(IncompatiblePeerError) as e:
        check_compatible(fp8, int8, peer="'decode-0'")
    text = str(e.value)
    assert "kv_cache_dtype: ours='fp8_e4m3' theirs='int8'" in text
    assert "ours fp8_e4m3 (float8_e4m3fn, scales: unit)" in text
    assert "theirs int8 (int8, scales: per-token-head:float32-after-head_dim)" in text
    # a scale layout this version does not know is refused too, never reinterpreted
    other = KVCompat("m", "int8", 16, 30, 3, 64, kv_cache_dtype="int8", scale_layout="per-block")
    with pytest.raises(IncompatiblePeerError, match="scale_layout"):
        check_compatible(int8, other)


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_compat_describes_the_engines_pool_of_every_format(kv, model_dtype):
    """compat.py keeps its own (torch-free) table of the formats: it must agree with the
    engine's pool (engine/kv/kv_pool.py, engine/kv/kv_format.py) on dtype, shape and bytes."""
    from engine.kv.kv_pool import allocate_kv_pool, kv_block_bytes
    from engine.models.config import ModelArgs

    args = ModelArgs(
        vocab_size=32,
        dim=48,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=12,
        intermediate_size=64,
        norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    pool = allocate_kv_pool(3, args, 16, model_dtype, torch.device("cpu"), kv)
    compat = KVCompat.for_pool(pool, "m", kv)
    compat.check_pool(pool)
    assert compat.head_dim == args.head_dim
    assert compat.block_bytes == kv_block_bytes(args, 16, model_dtype, kv) == pool[0].nbytes


def test_different_architectures_or_windows_are_refused_by_name():
    """Same pool shape, same directory name: a Mistral and a LLaMA checkpoint, or the same
    architecture with another sliding window, still never share KV."""
    pool = torch.zeros(4, 2, 2, 2, 16, 16)
    llama = KVCompat.for_pool(
        pool, "m", architecture="LlamaForCausalLM", layer_windows=window_layers([None, None])
    )
    mistral = KVCompat.for_pool(
        pool, "m", architecture="MistralForCausalLM", layer_windows=window_layers([8, 8])
    )
    assert mistral.layer_windows == "8,8" and llama.layer_windows == "full,full"
    with pytest.raises(
        IncompatiblePeerError,
        match="architecture: ours='LlamaForCausalLM' theirs='MistralForCausalLM'",
    ):
        check_compatible(llama, mistral)
    narrower = KVCompat.for_pool(
        pool, "m", architecture="MistralForCausalLM", layer_windows=window_layers([4, 4])
    )
    with pytest.raises(IncompatiblePeerError, match="layer_windows: ours='8,8' theirs='4,4'"):
        check_compatible(mistral, narrower)
    assert mistral.hash() != narrower.hash() != llama.hash()


def test_a_peer_of_the_old_layout_is_refused_by_the_layouts_name():
    """Before heads came first inside a block a pool was [N, L, 2, B, H, D]: the same bytes
    per block, so only the layout's name in the compat description keeps the two apart."""
    from kvtransfer.compat import BLOCK_MAJOR_LAYOUT, OLD_LAYOUTS

    assert DEFAULT.layout == BLOCK_MAJOR_LAYOUT and BLOCK_MAJOR_LAYOUT not in OLD_LAYOUTS
    old = KVCompat("smollm2-135m", "float32", 16, 30, 3, 64, layout=OLD_LAYOUTS[0])
    assert old.block_bytes == DEFAULT.block_bytes and old.hash() != DEFAULT.hash()
    with pytest.raises(IncompatiblePeerError, match="layout: ours='block-major-hnd") as e:
        check_compatible(DEFAULT, old, peer="'decode-old'")
    assert "theirs='block-major:[num_blocks,num_layers" in str(e.value)
    with pytest.raises(PoolError, match="KV layout 'block-major:"):
        old.check_pool(torch.zeros(4, 3, 30, 2, 16, 64))
