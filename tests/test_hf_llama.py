"""examples/hf_llama.py's parts that need no GPU, on a tiny LlamaConfig with the real
transformers and the CPU build of torch: the GEMMs it records, the decode step it times and
captures, and the speedup it predicts."""

import importlib.util
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402

from cudal2.shapes import MODELS  # noqa: E402

spec = importlib.util.spec_from_file_location("hf_llama", ROOT / "examples" / "hf_llama.py")
hf_llama = sys.modules["hf_llama"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf_llama)

LAYERS = 2


@pytest.fixture(scope="module")
def tiny():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return config, hf_llama.build(config, "cpu", torch.float32)


def test_the_config_has_llama_3_8b_dimensions():
    config = hf_llama.llama3_8b_config(3)
    head_dim = config.hidden_size // config.num_attention_heads
    projections = MODELS["llama3-8b"].projections
    assert config.num_hidden_layers == 3 and config.vocab_size == 128256
    assert (config.hidden_size, config.hidden_size) == projections["o_proj"]
    assert (config.hidden_size, config.intermediate_size) == projections["down_proj"]
    assert 2 * config.intermediate_size == projections["gate_up_proj"][0]
    assert config.hidden_size + 2 * config.num_key_value_heads * head_dim == projections["qkv_proj"][0]


def test_the_recorded_gemms_are_the_models_linear_calls(tiny):
    config, model = tiny
    prefill = hf_llama.gemm_calls(model, hf_llama.step(model, hf_llama.Case("prefill", 1, 12), config.vocab_size))
    # per layer q, o (64x64), k, v (32x64), gate, up (160x64), down (64x160); the vocabulary for the last token only
    assert prefill == {(12, 64, 64): 2 * LAYERS, (12, 32, 64): 2 * LAYERS, (12, 160, 64): 2 * LAYERS,
                       (12, 64, 160): LAYERS, (1, 96, 64): 1}
    decode = hf_llama.gemm_calls(model, hf_llama.step(model, hf_llama.Case("decode", 3, 10), config.vocab_size))
    assert set(decode) == {(3, 64, 64), (3, 32, 64), (3, 160, 64), (3, 64, 160), (3, 96, 64)}


def test_the_decode_step_is_the_next_tokens_logits_and_repeats_alike(tiny):
    config, model = tiny
    case = hf_llama.Case("decode", 2, 9)
    decode = hf_llama.step(model, case, config.vocab_size)
    with torch.no_grad():
        first, again = decode(), decode()
        # the same prompt and token as step() draws, run in one forward without a cache
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, config.vocab_size, (2, 9), generator=generator)
        token = torch.randint(0, config.vocab_size, (2, 1), generator=generator)
        whole = model(input_ids=torch.cat([prompt, token], 1), use_cache=False).logits[:, -1:]
    assert first.shape == (2, 1, config.vocab_size)
    assert torch.equal(first, again)  # each call writes the same cache position
    assert torch.allclose(first, whole, atol=1e-5, rtol=1e-4)


def test_the_prefill_is_the_prompts_last_logits_and_repeats_alike(tiny):
    config, model = tiny
    prefill = hf_llama.step(model, hf_llama.Case("prefill", 2, 11), config.vocab_size)
    with torch.no_grad():
        first, again = prefill(), prefill()
        prompt = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
        whole = model(input_ids=prompt, use_cache=False).logits[:, -1:]
    assert torch.equal(first, again)
    assert torch.allclose(first, whole, atol=1e-5, rtol=1e-4)


def test_the_predicted_speedup_weighs_each_gemm_by_its_share_of_the_step():
    calls = {(1, 64, 64): 4, (1, 32, 64): 2}
    library = {(1, 64, 64): 10.0, (1, 32, 64): 5.0}
    # the 64x64 GEMMs (40 of the step's 100 us) twice as fast, the other unchanged: 100 / 80
    assert hf_llama.predicted_speedup(100.0, calls, library, {(1, 64, 64): 5.0, (1, 32, 64): 5.0}) == 1.25
    assert hf_llama.predicted_speedup(100.0, calls, library, library) == 1.0
