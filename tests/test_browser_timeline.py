"""The real frontend in Debian's Chromium (Playwright, no browser download), opt-in:

    SDVG_COMFYUI_DIR=/work/comfyui SDVG_COMFYUI_PYTHON=/work/comfy-venv/bin/python \
        /work/comfy-venv/bin/python -m pytest -q tests/test_browser_timeline.py

Needs the host variables, /usr/bin/chromium and the ``playwright`` package (in the host venv). Loads the tiny
workflow, checks the frontend's own API export against our converter's twin, queues it and waits for one
timeline cell per block. Screenshots go to out/ (gitignored); the last one is copied to docs/ for the README.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.host import build_workflows, comfy_server
from tests.host.faulty_models import NAN_TARGET, write_nan_target

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(comfy_server.host_config() is None, reason=comfy_server.SKIP_REASON),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright not installed here: run with $SDVG_COMFYUI_PYTHON -m pytest"),
]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sdvg.fixtures.tiny import make_tiny

    root = tmp_path_factory.mktemp("models")
    make_tiny(root)
    write_nan_target(root)
    srv = comfy_server.ComfyServer(root).start()
    srv.post("/settings/Comfy.TutorialCompleted", True)
    srv.post("/settings/Comfy.Minimap.Visible", False)  # keeps the screenshot clear
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        pg = browser.new_page(viewport={"width": 1700, "height": 1000})
        pg.errors = []
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))
        pg.goto(server.base)
        pg.wait_for_function("() => window.__sdvgTimeline && window.app && window.app.graph", timeout=90000)
        yield pg
        browser.close()


def _load_tiny(page) -> None:
    workflow = json.loads(build_workflows.ui_path("sdvg_tiny_cpu").read_text(encoding="utf-8"))
    page.evaluate("async (wf) => { await app.loadGraphData(wf); }", workflow)


def _declared(info: dict, node_type: str) -> set[str]:
    spec = info[node_type]["input"]
    return set(spec.get("required", {})) | set(spec.get("optional", {}))


def test_frontend_export_matches_our_api_twin(server, page):
    _load_tiny(page)
    exported = page.evaluate("async () => (await app.graphToPrompt()).output")
    twin = json.loads((REPO / "tests" / "workflows" / "sdvg_tiny_cpu.api.json").read_text(encoding="utf-8"))
    info = server.get("/object_info")

    def strip(api):  # frontend-only widgets (PreviewAny's 'preview' box) are not node inputs: the server drops them
        return {k: {"class_type": v["class_type"],
                    "inputs": {n: x for n, x in v["inputs"].items() if n in _declared(info, v["class_type"])}}
                for k, v in api.items()}

    exported, twin = strip(exported), strip(twin)
    assert set(exported) == set(twin)
    for key, node in twin.items():
        got = exported[key]
        assert got["class_type"] == node["class_type"]
        assert {n: got["inputs"].get(n) for n in node["inputs"]} == node["inputs"], key
        # a newer host may add optional widgets (v0.27's CreateVideo: bit_depth); the frontend fills their defaults
        extra = set(got["inputs"]) - set(node["inputs"])
        assert extra <= set(info[node["class_type"]]["input"].get("optional", {})), (key, extra)
    has_widget = page.evaluate(
        "() => app.graph._nodes.filter(n => n.type === 'SDVGSpeculativeSampler').every(n => !!n.sdvgTimeline)"
    )
    assert has_widget
    saved = page.evaluate(
        "() => app.graph.serialize().nodes.find(n => n.type === 'SDVGSpeculativeSampler').widgets_values"
    )
    original = json.loads(build_workflows.ui_path("sdvg_tiny_cpu").read_text(encoding="utf-8"))
    assert saved == next(n for n in original["nodes"] if n["type"] == "SDVGSpeculativeSampler")["widgets_values"]


def test_timeline_fills_one_cell_per_block(server, page):
    _load_tiny(page)
    blocks = page.evaluate(
        "() => app.graph._nodes.find(n => n.type === 'SDVGSpeculativeSampler').widgets.find(w => w.name === 'blocks').value"
    )
    page.evaluate("() => app.queuePrompt(0, 1)")
    page.wait_for_function(
        "(n) => document.querySelectorAll('.sdvg-tl-cell[data-kind]').length >= n", arg=blocks, timeout=180000
    )
    page.wait_for_function("() => /·/.test(document.querySelector('.sdvg-tl-stats').textContent)", timeout=30000)
    kinds = page.evaluate("() => [...document.querySelectorAll('.sdvg-tl-cell')].map(c => c.dataset.kind)")
    assert len(kinds) == blocks and kinds[0] == "forced"
    assert set(kinds) <= {"accept", "reject", "forced"}
    # the tiny workflow's τ splits the tiny reward's scores: drafts are both kept and regenerated
    assert {"accept", "reject"} <= set(kinds), kinds
    assert page.evaluate("() => document.querySelectorAll('.sdvg-tl-dot').length") == blocks
    # the widget is laid out: header above the cells, cells inside the node's width, nothing overlapping
    boxes = page.evaluate(
        """() => { const r = (s) => document.querySelector(s).getBoundingClientRect();
                   const cells = [...document.querySelectorAll('.sdvg-tl-cell')].map(c => c.getBoundingClientRect());
                   return {head: r('.sdvg-tl-head'), cells: r('.sdvg-tl-cells'), chart: r('.sdvg-tl-chart'),
                           detail: r('.sdvg-tl-detail'), root: r('.sdvg-tl'),
                           widths: cells.map(c => c.width)}; }"""
    )
    assert boxes["head"]["bottom"] <= boxes["cells"]["top"] and boxes["cells"]["bottom"] <= boxes["chart"]["top"]
    assert boxes["chart"]["bottom"] <= boxes["detail"]["top"] <= boxes["detail"]["bottom"] <= boxes["root"]["bottom"] + 0.5
    assert sum(boxes["widths"]) > 0.8 * boxes["cells"]["width"]  # the cells fill the node's width
    # hover a regenerated block: its details and its own frames show in the panel
    reject = kinds.index("reject")
    _focus_on_sampler(page)
    page.hover(f".sdvg-tl-cell[data-block='{reject}']")
    page.wait_for_function("() => document.querySelector('.sdvg-tl-thumb.on')", timeout=10000)
    detail = page.evaluate("() => document.querySelector('.sdvg-tl-detail').textContent")
    assert f"block {reject}" in detail and "q_b" in detail and "τ" in detail and "mean" in detail, detail
    page.wait_for_timeout(500)
    out = REPO / "out"
    out.mkdir(exist_ok=True)
    shot = out / "sdvg_timeline.png"
    page.screenshot(path=str(shot))
    if os.environ.get("SDVG_UPDATE_DOCS_SCREENSHOT") == "1":  # refresh the README's picture only when asked
        shutil.copyfile(shot, REPO / "docs" / "sdvg_timeline.png")
    assert not [e for e in page.errors if "sdvg" in e.lower()], page.errors


_FIX_SEED = """(seed) => { const n = app.graph._nodes.find(n => n.type === 'SDVGSpeculativeSampler');
    const w = n.widgets.find(w => w.name === 'seed'); w.value = seed;
    const c = n.widgets.find(w => w.name === 'control_after_generate'); if (c) c.value = 'fixed'; }"""


def test_timeline_comes_back_when_the_run_is_fully_cached(server, page):
    """A reopened workflow whose run is cached gets no sdvg.* events: the widget rebuilds from the node's ui output."""
    _load_tiny(page)
    page.evaluate(_FIX_SEED, 4242)
    page.evaluate("() => app.queuePrompt(0, 1)")
    page.wait_for_function("() => /·/.test(document.querySelector('.sdvg-tl-stats').textContent)", timeout=180000)
    first = page.evaluate("() => [...document.querySelectorAll('.sdvg-tl-cell')].map(c => c.dataset.kind)")
    _load_tiny(page)  # a fresh node: an empty timeline
    assert page.evaluate("() => document.querySelectorAll('.sdvg-tl-cell[data-kind]').length") == 0
    page.evaluate(_FIX_SEED, 4242)
    page.evaluate("() => { window.__sdvgBlocks = 0; comfyAPI.api.api.addEventListener('sdvg.block', () => "
                  "window.__sdvgBlocks++); }")
    page.evaluate("() => app.queuePrompt(0, 1)")
    page.wait_for_function("(n) => document.querySelectorAll('.sdvg-tl-cell[data-kind]').length >= n",
                           arg=len(first), timeout=60000)
    again = page.evaluate("() => [...document.querySelectorAll('.sdvg-tl-cell')].map(c => c.dataset.kind)")
    assert again == first and page.evaluate("() => window.__sdvgBlocks") == 0  # rebuilt from the cache alone
    assert "·" in page.evaluate("() => document.querySelector('.sdvg-tl-stats').textContent")


_FAULT_AT_BLOCK_3 = """(nan) => { const g = app.graph._nodes, set = (n, k, v) => { n.widgets.find(w => w.name === k).value = v; };
    const get = (n, k) => n.widgets.find(w => w.name === k).value;
    set(g.find(n => n.type === 'SDVGModelLoader' && get(n, 'model_name') === 'sdvg_tiny_target.safetensors'),
        'model_name', nan);
    const r = g.find(n => n.type === 'SDVGRewardRouter');
    set(r, 'mode', 'pattern'); set(r, 'pattern', 'AAAR'); set(r, 'force_reject_first', false);
    set(g.find(n => n.type === 'SDVGSpeculativeSampler'), 'blocks', 4); }"""


def test_a_fault_shows_in_red_on_the_node_with_the_finished_blocks(server, page):
    """on_fault keep finished blocks: pattern AAAR sends block 3 to the NaN target; the timeline keeps blocks 0-2 and
    shows the error on the node."""
    _load_tiny(page)
    page.evaluate(_FAULT_AT_BLOCK_3, NAN_TARGET)
    page.evaluate("() => app.queuePrompt(0, 1)")
    page.wait_for_function("() => document.querySelector('.sdvg-tl-stats.fault')", timeout=180000)
    text = page.evaluate("() => document.querySelector('.sdvg-tl-stats').textContent")
    assert "The target produced NaN/inf latents in block 3" in text and "kept 3 block(s)" in text, text
    assert page.evaluate("() => document.querySelectorAll('.sdvg-tl-cell[data-kind]').length") == 3
    color = page.evaluate("() => getComputedStyle(document.querySelector('.sdvg-tl-stats')).color")
    assert color == "rgb(255, 123, 114)", color  # the fault red
    assert not [e for e in page.errors if "sdvg" in e.lower()], page.errors


def test_removing_the_node_releases_its_listeners(server, page):
    _load_tiny(page)
    before = page.evaluate("() => document.querySelectorAll('.sdvg-tl').length")
    assert before == 1
    page.evaluate(
        "() => { const n = app.graph._nodes.find(n => n.type === 'SDVGSpeculativeSampler'); window.__sdvgT = n.sdvgTimeline;"
        " app.graph.remove(n); }"
    )
    assert page.evaluate("() => Object.keys(window.__sdvgT.handlers).length") == 0
    assert page.evaluate("() => document.querySelectorAll('.sdvg-tl').length") == 0


def test_subgraph_execution_ids_are_resolved(server, page):
    """A node inside a subgraph is addressed as "<subgraph node id>:<local id>" (one id per instance, nested
    ids joined); a bare local id from another graph must not match it."""
    result = page.evaluate(
        """async () => {
             const m = await import('/extensions/sdvg/js/sdvg_timeline.js');  // the already loaded module
             const root = { isRootGraph: true, _nodes: [] };
             const inner = { rootGraph: root, _nodes: [] };
             const outer = { rootGraph: root, _nodes: [] };
             const node = { id: 12, graph: inner };
             outer._nodes.push({ id: 3, isSubgraphNode: () => true, subgraph: inner });
             root._nodes.push({ id: 5, isSubgraphNode: () => true, subgraph: inner },
                              { id: 8, isSubgraphNode: () => true, subgraph: outer }, { id: 12 });
             return { ids: m.executionIds(node).sort(),
                      hit: m.matchesNode(node, { node: '8:3:12', display_node: '8:3:12' }),
                      miss: m.matchesNode(node, { node: '12', display_node: '12' }),
                      kinds: [m.blockKind({ produced_by: 'drafter' }), m.blockKind({ produced_by: 'target', drafted: true }),
                              m.blockKind({ produced_by: 'target', drafted: false })] };
           }"""
    )
    assert result == {"ids": ["5:12", "8:3:12"], "hit": True, "miss": False, "kinds": ["accept", "reject", "forced"]}
    assert page.evaluate("() => window.__sdvgTimeline.version") == 3  # still one registration of the extension


def _focus_on_sampler(page) -> None:
    """Zoom the canvas onto the sampler and its outputs, so the screenshot shows the widget at a readable size."""
    page.evaluate(
        """() => { const n = app.graph._nodes.find(n => n.type === 'SDVGSpeculativeSampler');
                   const ds = app.canvas.ds; ds.scale = 1.05;
                   ds.offset[0] = -n.pos[0] + 40; ds.offset[1] = -n.pos[1] + 50;
                   app.canvas.setDirty(true, true); }"""
    )
    page.wait_for_timeout(800)
