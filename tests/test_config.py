import pytest

from course_lib import config as C, presets
from course_lib.capabilities import capabilities
from course_lib.ladder import ladder_configs


def test_presets_are_valid_and_shaped_as_documented():
    ref = C.reference_preset("cpu")
    assert (ref.model.n_layer, ref.model.n_embd, ref.model.n_head, ref.context, ref.batch_size) == (4, 256, 4, 512, 32)
    g = C.gpt2_small_preset("cpu")
    assert (g.model.n_layer, g.model.n_embd, g.model.n_head, g.model.block_size, g.model.vocab_size) == (
        12,
        768,
        12,
        1024,
        50257,
    )
    for name in presets.PRESET_NAMES:
        assert presets.preset(name, "cpu").device == "cpu"


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: C.ModelConfig(n_head=3, n_embd=64), "n_head=3 must divide n_embd=64"),
        (lambda: C.TrainConfig(batch_size=10, grad_accum_steps=4), "does not divide"),
        (lambda: C.TrainConfig(context=1024), "longer than the model's block_size"),
        (lambda: C.TrainConfig(precision="fp8"), "precision='fp8' is not one of"),
        (lambda: C.TrainConfig(grad_accum_steps=2.0), "grad_accum_steps takes an integer"),
        (lambda: C.TrainConfig(steps=0), "steps must be a positive int"),
        (lambda: C.ModelConfig(attention="flashy"), "attention='flashy' is not one of"),
        (lambda: C.ModelConfig(attention="flash", dropout=0.1), "(the course's flash attention) has no dropout"),
    ],
)
def test_invalid_configs_say_what_to_change(make, words):
    with pytest.raises(C.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_batch_split_and_tokens():
    cfg = C.TrainConfig(batch_size=32, grad_accum_steps=4, context=128)
    assert cfg.micro_batch_size == 8 and cfg.tokens_per_step == 32 * 128


def test_vocab_padding():
    assert C.ModelConfig(vocab_size=50257, vocab_multiple=64).padded_vocab_size == 50304
    assert C.ModelConfig(vocab_size=4097, vocab_multiple=1).padded_vocab_size == 4097


def test_config_round_trips_through_dict():
    cfg = C.cpu_preset("cpu").with_model(attention="sdpa")
    assert C.TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_ladder_is_cumulative_from_naive():
    rungs = ladder_configs(C.cpu_preset("cpu"))
    cfgs = [c for _, c in rungs]
    assert all(isinstance(c, C.TrainConfig) for c in cfgs)
    first, last = cfgs[0], cfgs[-1]
    assert (first.precision, first.model.attention, first.compile, first.fused_adamw) == ("fp32", "naive", False, False)
    # the 16-bit format this CPU runs fast, else bf16 (measured, then dropped)
    fast = capabilities("cpu").fast_16bit()[0] or "bf16"
    assert (last.precision, last.model.attention, last.compile, last.fused_adamw, last.activation_checkpointing) == (
        fast,
        "sdpa",
        True,
        True,
        "full",
    )
    assert last.model.padded_vocab_size % 64 == 0
