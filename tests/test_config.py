import re
from pathlib import Path

import pytest

from kvcached.config import VARIABLES, Config, markdown_table
from kvcached.errors import ConfigError
from kvcached.units import GIB, MIB, format_bytes, parse_size


def test_defaults_follow_upstream():
    c = Config.from_env({})
    assert c.enabled is False
    assert c.autopatch is True
    assert c.ipc_name is None
    assert c.contiguous_layout is None
    assert c.gpu_utilization == 0.95
    assert c.page_size == 2 * MIB
    assert (c.min_reserved_pages, c.max_reserved_pages) == (5, 10)
    assert c.max_cached_tokens == 16000
    assert c.log_level == "INFO"
    assert c.driver == "auto"
    assert c.host_capacity is None
    assert c.ledger_dir == "/dev/shm"
    assert c.calibration_interval_s == 1.0
    assert not hasattr(c, "overlap_page_ops"), "retired: page ops always run beside the step"


@pytest.mark.parametrize("value", ["true", "1", " Yes "])
def test_a_retired_switch_set_to_what_kvcached_does_is_ignored(value: str) -> None:
    Config.from_env({"KVCACHED_OVERLAP_PAGE_OPS": value})


@pytest.mark.parametrize("value", ["false", "0", "maybe"])
def test_a_retired_switch_set_otherwise_is_refused_with_the_reason(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_env({"KVCACHED_OVERLAP_PAGE_OPS": value})
    assert err.value.variable == "KVCACHED_OVERLAP_PAGE_OPS"
    assert "beside" in str(err.value) and "unset it" in str(err.value)


@pytest.mark.parametrize(
    "name,value,field,expected",
    [
        ("ENABLE_KVCACHED", "true", "enabled", True),
        ("ENABLE_KVCACHED", "1", "enabled", True),
        ("ENABLE_KVCACHED", "OFF", "enabled", False),
        ("KVCACHED_AUTOPATCH", "0", "autopatch", False),
        ("KVCACHED_IPC_NAME", "vllm-a", "ipc_name", "vllm-a"),
        ("KVCACHED_CONTIGUOUS_LAYOUT", "true", "contiguous_layout", True),
        ("KVCACHED_CONTIGUOUS_LAYOUT", "false", "contiguous_layout", False),
        ("KVCACHED_CONTIGUOUS_LAYOUT", "auto", "contiguous_layout", None),
        ("KVCACHED_GPU_UTILIZATION", "0.5", "gpu_utilization", 0.5),
        ("KVCACHED_GPU_UTILIZATION", "1", "gpu_utilization", 1.0),
        ("KVCACHED_PAGE_SIZE_MB", "4", "page_size", 4 * MIB),
        ("KVCACHED_MIN_RESERVED_PAGES", "0", "min_reserved_pages", 0),
        ("KVCACHED_MAX_RESERVED_PAGES", "20", "max_reserved_pages", 20),
        ("KVCACHED_BESIDE_STEPS", "1", "beside_steps", 1),
        ("KVCACHED_MAX_CACHED_TOKENS", "-1", "max_cached_tokens", -1),
        ("KVCACHED_MAX_CACHED_TOKENS", "0", "max_cached_tokens", 0),
        ("KVCACHED_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("KVCACHED_DRIVER", "HOST", "driver", "host"),
        ("KVCACHED_HOST_CAPACITY", "1.5g", "host_capacity", int(1.5 * GIB)),
        ("KVCACHED_HOST_CAPACITY", "512M", "host_capacity", 512 * MIB),
        ("KVCACHED_LEDGER_DIR", "/tmp/x", "ledger_dir", "/tmp/x"),
        ("KVCACHED_CALIBRATION_INTERVAL_S", "0.25", "calibration_interval_s", 0.25),
    ],
)
def test_each_variable_parses(name, value, field, expected):
    assert getattr(Config.from_env({name: value}), field) == expected


@pytest.mark.parametrize(
    "name,value,hint",
    [
        ("KVCACHED_GPU_UTILIZATION", "1.5", "(0, 1]"),
        ("KVCACHED_GPU_UTILIZATION", "0", "(0, 1]"),
        ("KVCACHED_GPU_UTILIZATION", "most", "(0, 1]"),
        ("KVCACHED_PAGE_SIZE_MB", "3", "multiple of 2"),
        ("KVCACHED_PAGE_SIZE_MB", "0", "multiple of 2"),
        ("KVCACHED_PAGE_SIZE_MB", "2.0", "multiple of 2"),
        ("ENABLE_KVCACHED", "maybe", "true/false"),
        ("KVCACHED_AUTOPATCH", "2", "true/false"),
        ("KVCACHED_CONTIGUOUS_LAYOUT", "yes please", "auto"),
        ("KVCACHED_MIN_RESERVED_PAGES", "-1", ">= 0"),
        ("KVCACHED_BESIDE_STEPS", "0", ">= 1"),
        ("KVCACHED_BESIDE_STEPS", "-3", ">= 1"),
        ("KVCACHED_BESIDE_STEPS", "some", ">= 1"),
        ("KVCACHED_MAX_CACHED_TOKENS", "lots", "whole number"),
        ("KVCACHED_LOG_LEVEL", "LOUD", "DEBUG"),
        ("KVCACHED_DRIVER", "metal", "cuda"),
        ("KVCACHED_HOST_CAPACITY", "12 parsecs", "512M"),
        ("KVCACHED_HOST_CAPACITY", "0", "above zero"),
        ("KVCACHED_IPC_NAME", "has space", "letters"),
        ("KVCACHED_IPC_NAME", "x" * 49, "48"),
        ("KVCACHED_CALIBRATION_INTERVAL_S", "0", "above 0"),
    ],
)
def test_bad_values_name_variable_value_and_allowed(name, value, hint):
    with pytest.raises(ConfigError) as err:
        Config.from_env({name: value})
    text = str(err.value)
    assert name in text and repr(value) in text and hint in text
    assert err.value.variable == name


def test_max_reserved_below_min_is_refused():
    with pytest.raises(
        ConfigError, match="KVCACHED_MAX_RESERVED_PAGES.*KVCACHED_MIN_RESERVED_PAGES"
    ):
        Config.from_env({"KVCACHED_MIN_RESERVED_PAGES": "8", "KVCACHED_MAX_RESERVED_PAGES": "4"})


def test_config_is_frozen():
    c = Config.from_env({})
    with pytest.raises(AttributeError):
        c.enabled = True  # type: ignore[misc]


def test_every_variable_maps_to_a_field():
    fields = set(Config.__dataclass_fields__)
    assert {v.field for v in VARIABLES} == fields
    assert len({v.name for v in VARIABLES}) == len(VARIABLES)


def test_docs_table_matches_code():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- variables:begin -->\n(.*?)\n<!-- variables:end -->", doc, re.S)
    assert block, "docs/configuration.md lacks the <!-- variables:begin/end --> block"
    assert block.group(1).strip() == markdown_table().strip(), (
        "docs/configuration.md's variable table drifted from kvcached/config.py; regenerate it with "
        "`python -m kvcached.config`"
    )


@pytest.mark.parametrize(
    "text,value",
    [
        ("512M", 512 * MIB),
        ("2G", 2 * GIB),
        ("1.5g", int(1.5 * GIB)),
        ("1048576", MIB),
        ("4GiB", 4 * GIB),
        ("64mb", 64 * MIB),
        (" 3 k ", 3 * 1024),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "-1G", "G", "1.2.3", "5 parsecs", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="512M"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536 * MIB) == "1.50 GiB"
    assert format_bytes(-2 * MIB) == "-2.00 MiB"
