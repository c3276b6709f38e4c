"""Cards: the config names them, units select them per engine, and exclude each other by overlap."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from appliance import config
from appliance import layout as config_mod
from appliance.errors import ConfigError
from appliance.host import placement
from appliance.host.gpu.fit import judge_start_all
from appliance.host.gpu.sysfs import Device
from appliance.host.placement import placements
from appliance.layout import UNIT_SUFFIXES, Scope, layout
from appliance.units import runtimes
from appliance.units.render import render_all
from b70tools import gpu_trees as t
from tests.test_render import analyze_verify, unit_lines, verify_root

B70, IGPU = 0xE223, 0xA780
# An integrated GPU sorts first, so the B70s are Level Zero ordinals 1-3, not 0-2; a card of
# another vendor is no Level Zero device at all.
BOX = [
    Device("0000:00:02.0", 0x8086, IGPU, "i915", "card0", "renderD128"),
    Device("0000:03:00.0", 0x8086, B70, "xe", "card1", "renderD129"),
    Device("0000:04:00.0", 0x10DE, 0x2684, "nvidia", "card2", "renderD130"),
    Device("0000:83:00.0", 0x8086, B70, "xe", "card4", "renderD132"),
    Device("0000:07:00.0", 0x8086, B70, "xe", "card3", "renderD131"),
]

HEAD = """
default_runtime = "tp"
b70ctl = "/opt/b70/bin/b70ctl"
[gpu]
{gpu}
"""
TP_AND_VISION = """
[runtimes.tp]
engine = "vllm"
model = "/m"
cards = [0, 1]
[runtimes.vision]
engine = "llamacpp"
command = ["/opt/llama.cpp/bin/llama-server"]
model = "/m.gguf"
cards = [1]
[runtimes.ctr]
engine = "vllm"
launcher = "docker"
image = "ghcr.io/x/vllm:1"
model = "/m"
cards = [2, 1]
"""


def parse(text: str) -> config.Config:
    return config.parse(text, Path("cards.toml"))


def placed(gpu: str = 'cards = "auto"', runtimes: str = TP_AND_VISION) -> dict[str, str]:
    return render_all(parse(HEAD.format(gpu=gpu) + runtimes), layout(Scope.SYSTEM), BOX)


SELECTION = ("ZE_AFFINITY_MASK", "ZE_ENABLE_PCI_ID_DEVICE_ORDER", "ONEAPI_DEVICE_SELECTOR")


def env_of(unit: str) -> dict[str, str]:
    """The device selection among a unit's Environment= lines."""
    pairs = (v.strip('"').split("=", 1) for v in unit_lines(unit, "Environment"))
    return {k: v for k, v in pairs if k in SELECTION}


def test_auto_takes_every_b70_in_pci_order_and_numbers_them_as_level_zero_does() -> None:
    cards = placement.card_list(parse(HEAD.format(gpu='cards = "auto"') + TP_AND_VISION), BOX)
    assert [(c.index, c.pci, c.ordinal, c.render) for c in cards] == [
        (0, "0000:03:00.0", 1, "renderD129"),
        (1, "0000:07:00.0", 2, "renderD131"),
        (2, "0000:83:00.0", 3, "renderD132"),
    ]


def test_native_vllm_on_two_cards_runs_tensor_parallel_under_one_affinity_mask() -> None:
    unit = placed()["b70-tp.service"]
    assert env_of(unit) == {"ZE_AFFINITY_MASK": "1,2", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    start = unit_lines(unit, "ExecStart")[0]
    assert "--tensor-parallel-size 2" in start
    assert "cards 0-1 (0000:03:00.0, 0000:07:00.0)" in unit_lines(unit, "Description")[0]
    guard = unit_lines(unit, "ExecStartPre")[0]
    assert "--device 0000:03:00.0 --device 0000:07:00.0 " in guard


def test_llamacpp_gets_the_sycl_selector_and_one_card_no_tensor_parallel() -> None:
    unit = placed()["b70-vision.service"]
    assert env_of(unit)["ONEAPI_DEVICE_SELECTOR"] == "level_zero:2"
    assert "tensor-parallel" not in unit
    assert unit_lines(unit, "ExecStartPre")[0].count("--device ") == 1


def test_a_container_gets_only_its_cards_nodes_numbered_from_zero_inside() -> None:
    unit = placed()["b70-ctr.service"]
    start = unit_lines(unit, "ExecStart")[0]
    # cards = [2, 1]: the runtime's order; nodes under the host's names, by-path for oneCCL.
    assert (
        "--device /dev/dri/renderD132 --device /dev/dri/card4 "
        "--device /dev/dri/renderD131 --device /dev/dri/card3 " in start
    )
    assert "/dev/dri/renderD129" not in start and "--device /dev/dri " not in start
    assert "--volume /dev/dri/by-path:/dev/dri/by-path:ro" in start
    assert "--env ZE_AFFINITY_MASK" in start and "--env ZE_ENABLE_PCI_ID_DEVICE_ORDER" in start
    assert env_of(unit)["ZE_AFFINITY_MASK"] == "0,1"


def test_explicit_addresses_index_as_listed() -> None:
    gpu = 'cards = ["0000:83:00.0", "0000:03:00.0", "0000:07:00.0"]'
    unit = placed(gpu)["b70-vision.service"]
    assert env_of(unit)["ONEAPI_DEVICE_SELECTOR"] == "level_zero:1"  # card 1 = 0000:03:00.0


def test_a_config_without_cards_renders_no_selection_and_reads_no_sysfs() -> None:
    cfg = parse(
        HEAD.format(gpu="") + '[runtimes.tp]\nengine = "vllm"\nmodel = "/m"\n'
        '[runtimes.b]\nengine = "llamacpp"\nmodel = "/m.gguf"\n'
    )
    assert placements(cfg, devices=None) is None
    unit = render_all(cfg, layout(Scope.SYSTEM), devices=[])["b70-tp.service"]
    assert env_of(unit) == {} and "--device auto" in unit
    assert "b70-b.service" in unit_lines(unit, "Conflicts")


@pytest.mark.parametrize(
    ("gpu", "runtime_cards", "message"),
    [
        ('cards = ["0000:05:00.0"]', "[0]", "gpu.cards[0]: 0000:05:00.0 is no GPU on this"),
        ('cards = ["0000:04:00.0"]', "[0]", "0000:04:00.0 is not an Intel GPU under xe or i915"),
        ('cards = "auto"', "[3]", "runtimes.one.cards: card 3 is not in the appliance's card"),
    ],
)
def test_cards_this_machine_does_not_have_are_named(
    gpu: str, runtime_cards: str, message: str
) -> None:
    text = HEAD.format(gpu=gpu).replace('"tp"', '"one"')
    text += f'[runtimes.one]\nengine = "vllm"\nmodel = "/m"\ncards = {runtime_cards}\n'
    with pytest.raises(ConfigError) as raised:
        render_all(parse(text), layout(Scope.SYSTEM), BOX)
    assert message in str(raised.value) and "`b70ctl gpu` lists" in (raised.value.hint or "")


RUNTIME = '[runtimes.one]\nengine = "{engine}"\nmodel = "/m"\n{extra}\n'
# Commands that the verify root holds as stub executables.
COMMAND = {
    "vllm": 'command = ["/usr/bin/docker"]',
    "llamacpp": 'command = ["/opt/llama.cpp/bin/llama-server"]',
}


@pytest.mark.parametrize(
    ("gpu", "extra", "key", "what"),
    [
        ("cards = []", "", "gpu.cards", "empty list"),
        ("cards = 3", "", "gpu.cards", "must be"),
        ('cards = ["03:00.0"]', "", "gpu.cards[0]", "not a PCI address"),
        ('cards = ["0000:03:00.0", "0000:03:00.0"]', "", "gpu.cards[1]", "listed twice"),
        ('device = "auto"\ncards = "auto"', "", "gpu.cards", "use one"),
        ("", "cards = []", "runtimes.one.cards", "list of card indices"),
        ("", 'cards = ["0"]', "runtimes.one.cards", "list of card indices"),
        ("", "cards = [true]", "runtimes.one.cards", "list of card indices"),
        ("", "cards = [-1]", "runtimes.one.cards[0]", "not a card index"),
        ("", "cards = [0, 0]", "runtimes.one.cards[1]", "listed twice"),
        ('cards = ["0000:03:00.0"]', "cards = [1]", "runtimes.one.cards[0]", "lists 1"),
        ("", 'cards = [0, 1]\nargs = ["-tp", "2"]', "runtimes.one.args", "sets -tp"),
        ("", 'cards = [0]\nenv = {ZE_AFFINITY_MASK = "3"}', "env.ZE_AFFINITY_MASK", "sets"),
    ],
)
def test_bad_cards_are_named_with_their_key(gpu: str, extra: str, key: str, what: str) -> None:
    text = HEAD.format(gpu=gpu).replace('"tp"', '"one"') + RUNTIME.format(
        engine="vllm", extra=extra
    )
    with pytest.raises(ConfigError) as raised:
        parse(text)
    assert key in str(raised.value) and what in str(raised.value)


TWO = '[runtimes.a]\nengine = "vllm"\nmodel = "/m"\n{a}\n[runtimes.b]\nengine = "vllm"\nmodel = "/m"\n{b}\n'


@pytest.mark.parametrize(
    ("runtimes", "pattern"),
    [
        (
            '[runtimes.a]\nengine = "vllm"\nlauncher = "docker"\nimage = "x/y:1"\n'
            'model = "/m"\ncards = [0]\ndevices = ["/dev/dri"]\n',
            r"runtimes\.a\.devices\[0\]: /dev/dri would give the container cards besides",
        ),
        (
            TWO.format(a="cards = [0]", b="cards = [1]"),
            r"runtimes\.b\.port: 8001 is also the port of runtimes\.a, and they share no card",
        ),
        (
            TWO.format(a="cards = [0]", b='cards = [0]\nserved_model_name = "other"'),
            r"runtimes\.b\.served_model_name: 'other' on port 8001, where runtimes\.a serves",
        ),
        (
            TWO.format(a="cards = [0, 1]", b="cards = [1]\nport = 8002"),
            r"runtimes\.b\.port: .* share a card, so they take turns, and both serve 'b70'",
        ),
        (
            TWO.format(a="port = 8000", b=""),
            r"runtimes\.a\.port: 8000 is also proxy\.port",
        ),
        (
            '[proxy]\naliases = ["default"]\n'
            + TWO.format(a='served_model_name = "default"', b=""),
            r"runtimes\.a\.served_model_name: 'default' is one of proxy\.aliases",
        ),
    ],
)
def test_runtimes_that_cannot_serve_as_placed_are_refused(runtimes: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        parse(HEAD.format(gpu="").replace('"tp"', '"a"') + runtimes)


def test_runtimes_on_disjoint_cards_serve_side_by_side_each_on_its_port() -> None:
    cfg = parse(
        HEAD.format(gpu="").replace('"tp"', '"a"')
        + TWO.format(a="cards = [0]", b='cards = [1]\nport = 8002\nserved_model_name = "vision"')
    )
    a, b = cfg.runtime("a"), cfg.runtime("b")
    assert (a.port, a.served_model_name) == (8001, "b70")
    assert (b.port, b.served_model_name) == (8002, "vision")
    assert runtimes.deployments(cfg) == {
        8001: ("b70", "http://127.0.0.1:8001"),
        8002: ("vision", "http://127.0.0.1:8002"),
    }
    assert runtimes.engine_argv(cfg, b)[:6] == [
        "--model", "/m", "--served-model-name", "vision", "--host", "127.0.0.1"
    ]  # fmt: skip


def random_assignment(rng: random.Random, names: list[str], n_cards: int) -> dict[str, tuple]:
    return {name: tuple(rng.sample(range(n_cards), rng.randint(1, n_cards))) for name in names}


REPLICAS = """
[proxy]
model = "small"
[runtimes.old]
engine = "llamacpp"
command = ["/opt/llama.cpp/bin/llama-server"]
model = "/old.gguf"
cards = [0, 1, 2]
per_card = true
[runtimes.new]
engine = "llamacpp"
command = ["/opt/llama.cpp/bin/llama-server"]
model = "/new.gguf"
cards = [0, 1, 2]
per_card = true
"""


def test_one_replica_per_card_is_a_runtime_per_card_behind_one_name(tmp_path: Path) -> None:
    """`per_card = true`: a replica on each card, each on its own port, all under the one name;
    two such sets on the same cards take turns replica by replica."""
    cfg = parse(HEAD.format(gpu='cards = "auto"').replace('"tp"', '"old"') + REPLICAS)
    assert cfg.groups == {"new": ("new-0", "new-1", "new-2"), "old": ("old-0", "old-1", "old-2")}
    assert cfg.members("old") == ("old-0", "old-1", "old-2") and cfg.members("new-1") == ("new-1",)
    assert [(r.cards, r.port) for r in map(cfg.runtime, cfg.members("new"))] == [
        ((0,), 8001), ((1,), 8002), ((2,), 8003)
    ]  # fmt: skip
    assert runtimes.deployments(cfg) == {
        port: ("small", f"http://127.0.0.1:{port}") for port in (8001, 8002, 8003)
    }
    files = render_all(cfg, layout(Scope.SYSTEM), BOX)
    assert unit_lines(files["b70-new-1.service"], "Conflicts") == ["b70-old-1.service"]
    assert "ONEAPI_DEVICE_SELECTOR=level_zero:2" in files["b70-new-1.service"]
    assert files[config_mod.PROXY_CONFIG].count('- model_name: "small"') == 3
    units = [n for n in files if n.endswith(UNIT_SUFFIXES)]
    assert analyze_verify(verify_root(tmp_path, files), units) == ""


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ("cards = [0, 1, 2]\nper_card = true", None),
        ("per_card = true", r"runtimes\.tp\.per_card: one replica per card needs the cards"),
        ("cards = [0]\nper_card = 1", r"runtimes\.tp\.per_card: must be"),
    ],
)
def test_a_replica_set_needs_its_cards(change: str, pattern: str | None) -> None:
    text = HEAD.format(gpu="").replace('"tp"', '"tp"') + (
        '[runtimes.tp]\nengine = "vllm"\nmodel = "/m"\n' + change + "\n"
    )
    if pattern is None:
        assert parse(text).default_runtime == "tp" and len(parse(text).groups["tp"]) == 3
        return
    with pytest.raises(ConfigError, match=pattern):
        parse(text)


@pytest.mark.parametrize("seed", range(6))
def test_random_placements_conflict_exactly_where_cards_intersect(
    seed: int, tmp_path: Path
) -> None:
    """Runtimes on random cards, each on a port of its own: Conflicts= exactly where their cards
    intersect, After= on one side of each such pair, and systemd-analyze verify is content."""
    rng = random.Random(seed)
    engines = ["vllm", "llamacpp"]
    text = HEAD.format(gpu='cards = "auto"').replace('"tp"', '"r0"')
    names = [f"r{i}" for i in range(rng.randint(2, 5))]
    cards = random_assignment(rng, names, 3)
    for i, name in enumerate(names):
        engine = rng.choice(engines)
        extra = f"{COMMAND[engine]}\ncards = {list(cards[name])}\nport = {8001 + i}"
        extra += f'\nserved_model_name = "{name}"'
        text += RUNTIME.format(engine=engine, extra=extra).replace("one", name)
    cfg = parse(text)
    files = render_all(cfg, layout(Scope.SYSTEM), BOX)
    for a, b in itertools.combinations(names, 2):
        ua, ub = f"b70-{a}.service", f"b70-{b}.service"
        meet = bool(set(cards[a]) & set(cards[b]))
        assert (ub in unit_lines(files[ua], "Conflicts")) is meet, (a, b, cards)
        assert (ua in unit_lines(files[ub], "Conflicts")) is meet, (a, b, cards)
        after = (ub in unit_lines(files[ua], "After")) + (ua in unit_lines(files[ub], "After"))
        assert after == (1 if meet else 0), (a, b, cards)
    units = [n for n in files if n.endswith(UNIT_SUFFIXES)]
    assert analyze_verify(verify_root(tmp_path, files), units) == ""


def test_a_runtime_does_not_fit_when_any_of_its_cards_is_short(tmp_path: Path) -> None:
    from appliance.host import gpu

    gib = 1024**3
    root = t.build(
        tmp_path,
        [
            t.Card("0000:03:00.0", card="card1", render="renderD128"),
            t.Card("0000:07:00.0", card="card2", render="renderD129", vram_used=30 * gib),
        ],
        [],
    )
    snap = gpu.snapshot(root)
    assert judge_start_all(snap, ["0000:03:00.0"], 20 * gib, None).ok
    both = judge_start_all(snap, ["0000:03:00.0", "0000:07:00.0"], 20 * gib, None)
    assert not both.ok and both.reason.startswith("0000:07:00.0: ")


def two_b70s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> config.Config:
    """A sysfs tree with two B70s, read as this machine's; a config with tp and vision on it."""
    root = t.build(
        tmp_path,
        [
            t.Card("0000:03:00.0", card="card1", render="renderD128"),
            t.Card("0000:07:00.0", card="card2", render="renderD129"),
        ],
        [],
    )
    monkeypatch.setenv("B70_SYSROOT", str(root))
    return parse(HEAD.format(gpu='cards = "auto"') + TP_AND_VISION.split("[runtimes.ctr]")[0])


def test_install_places_on_the_sysfs_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = two_b70s(tmp_path, monkeypatch)
    unit = render_all(cfg, layout(Scope.SYSTEM))["b70-vision.service"]
    assert env_of(unit)["ONEAPI_DEVICE_SELECTOR"] == "level_zero:1"


def test_status_names_each_runtimes_cards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.cli import output
    from appliance.watch.status import cards_view

    cfg = two_b70s(tmp_path, monkeypatch)
    view = cards_view(cfg)
    assert view == {
        "b70-tp.service": "cards 0-1 (0000:03:00.0, 0000:07:00.0)",
        "b70-vision.service": "card 1 (0000:07:00.0)",
    }
    unit = {"active": "active", "sub": "running", "enabled": "enabled", "main_pid": 7}
    units = [{**unit, "unit": u, "restarts": 0, "cards": c} for u, c in view.items()]
    units.append({**unit, "unit": "b70-litellm.service", "restarts": 0, "cards": None})
    text = output.render_status(
        {
            "active_runtime": "tp",
            "active_runtimes": ["tp"],
            "units": units,
            "backend": {"url": "http://127.0.0.1:8001", "healthy": True, "detail": ""},
            "proxy": {"url": "http://127.0.0.1:8000", "healthy": True, "detail": ""},
        }
    )
    lines = text.splitlines()
    assert lines[1].split()[-1] == "CARDS"
    assert lines[2].endswith("cards 0-1 (0000:03:00.0, 0000:07:00.0)")
    assert lines[4].split()[-1] == "-"
    monkeypatch.setenv("B70_SYSROOT", str(tmp_path / "empty"))
    assert cards_view(cfg)["b70-vision.service"] == "cards 1 (not all found)"


def test_the_four_card_example_renders_and_verifies_on_a_four_b70_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import REPO
    from tests.test_render import STUB_EXECUTABLES

    slots = ["0000:03:00.0", "0000:07:00.0", "0000:83:00.0", "0000:87:00.0"]
    host = t.healthy_host(tmp_path / "host", slots)
    monkeypatch.setenv("B70_SYSROOT", str(host))
    cfg = config.load(REPO / "examples" / "b70-4cards.toml")
    files = render_all(cfg, layout(Scope.SYSTEM))
    tp, vision = files["b70-vllm-tp4.service"], files["b70-llamacpp.service"]
    start = unit_lines(tp, "ExecStart")[0]
    assert "--tensor-parallel-size 4" in start and start.count("--device /dev/dri/") == 8
    assert env_of(tp)["ZE_AFFINITY_MASK"] == "0,1,2,3"
    assert env_of(vision)["ONEAPI_DEVICE_SELECTOR"] == "level_zero:3"
    assert unit_lines(tp, "Conflicts") == ["b70-llamacpp.service"]
    guard = unit_lines(tp, "ExecStartPre")[1]
    assert [guard.split()[i + 1] for i, w in enumerate(guard.split()) if w == "--device"] == slots
    assert "cards 0-3" in unit_lines(tp, "Description")[0]
    root = verify_root(tmp_path, files)
    assert "opt/llama.cpp/bin/llama-server" in STUB_EXECUTABLES
    units = [n for n in files if n.endswith(UNIT_SUFFIXES)]
    assert analyze_verify(root, units) == ""


def test_a_switchs_preflight_judges_the_targets_own_cards(tmp_path: Path) -> None:
    """A foreign holder on the target's second card is found by the preflight, before the old
    runtime is stopped, not first by the unit's GPU-memory guard after it ([gpu] device is the first
    card, which is free)."""
    from appliance.host import gpu
    from appliance.switch.preflight import memory_verdicts

    root = t.build(
        tmp_path,
        [
            t.Card("0000:03:00.0", card="card1", render="renderD128"),
            t.Card("0000:07:00.0", card="card2", render="renderD129", vram_used=31 * t.GIB),
        ],
        [t.Proc(5151, ["python3", "train.py"], t.FOREIGN_CGROUP, [
            t.Client(fd=9, slot="0000:07:00.0", client_id=31, resident="30720 MiB",
                     render="renderD129"),
        ])],
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as m:
        m.setenv("B70_SYSROOT", str(root))
        gpu_table = 'cards = "auto"\nmemory_needed_gib = 20'
        cfg = parse(HEAD.format(gpu=gpu_table) + TP_AND_VISION.split("[runtimes.ctr]")[0])
        snap = gpu.snapshot(root)
        tp = memory_verdicts(cfg, cfg.runtimes["tp"], snap)
        vision = memory_verdicts(cfg, cfg.runtimes["vision"], snap)
    assert [v.device for v in tp] == ["0000:03:00.0", "0000:07:00.0"]
    assert tp[0].ok and not tp[1].ok
    assert "python3 train.py" in tp[1].reason or "5151" in tp[1].reason, tp[1].reason
    assert [(v.device, v.ok) for v in vision] == [("0000:07:00.0", False)]
