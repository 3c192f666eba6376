// SDVG timeline widget for the SDVG Speculative Sampler node.
//
// Listens to the pack's websocket events (sdvg.start / sdvg.block / sdvg.preview / sdvg.done) and to this
// node's block previews (b_preview_with_metadata) and draws, from top to bottom:
//   * a header: progress on the left, acceptance / speed on the right (one line, never over the cells);
//   * a legend and one cell per block, sized to the node width, coloured by outcome:
//       accept = the draft was kept, reject = the draft was rejected and the target regenerated the block,
//       forced = the target made the block without a draft (block 0, target-only mode);
//       input  = a given block (SDVG Start Frames: image-to-video, extension), neither drafted nor scored;
//   * q_b per block against the τ line (dots on the block columns; τ dashed, labelled);
//   * a detail panel: the block under the mouse (or the latest one) with decision, reason, q_b, τ, per-frame
//     min / mean and timings, plus that block's frames while hovering.
// The latest block's frames are the node's own preview (ComfyUI draws it below the widgets), so the widget does
// not repeat them. All text goes through textContent; nothing from the server is parsed as HTML. The widget is
// never serialized into the workflow, and its listeners and object URLs are released when the node is removed.

const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

const NODE_TYPE = "SDVGSpeculativeSampler";
const EXT_NAME = "sdvg.timeline";
const STYLE_ID = "sdvg-timeline-style";
const MAX_COLS = 24; // more blocks than this wrap into rows
const CELL_H = 18;
const CHART_H = 64;
const DETAIL_H = 46;
const MARGIN = 6; // the DOM widget's margin around the element (ComfyUI's default is 10)

export const KINDS = {
  accept: { label: "draft accepted", color: "#4fbf7a" },
  reject: { label: "target after rejected draft", color: "#e8684a" },
  forced: { label: "target, no draft", color: "#5b8def" },
  input: { label: "given frames", color: "#8c8c96" },
};

const CSS = `
.sdvg-tl { display: flex; flex-direction: column; gap: 5px; font: 11px/1.3 system-ui, sans-serif; color: #d8dae0;
  background: #1b1d24; border: 1px solid #2c2f3a; border-radius: 6px; padding: 6px 7px; box-sizing: border-box;
  width: 100%; height: 100%; overflow: hidden; pointer-events: auto; }
.sdvg-tl > * { flex: 0 0 auto; min-width: 0; }
.sdvg-tl-head { display: flex; align-items: baseline; gap: 8px; height: 15px; white-space: nowrap; }
.sdvg-tl-title { font-weight: 600; color: #f0f1f4; flex: 0 0 auto; }
.sdvg-tl-stats { flex: 1 1 auto; min-width: 0; text-align: right; color: #aab0c0; overflow: hidden;
  text-overflow: ellipsis; }
.sdvg-tl-legend { display: flex; gap: 10px; height: 13px; color: #9aa0b0; font-size: 10px; white-space: nowrap;
  overflow: hidden; }
.sdvg-tl-legend i { display: inline-block; width: 8px; height: 8px; border-radius: 2px; margin-right: 4px;
  vertical-align: -1px; }
.sdvg-tl-cells { display: grid; gap: 2px; }
.sdvg-tl-cell { height: ${CELL_H}px; border-radius: 3px; text-align: center; line-height: ${CELL_H}px;
  font-size: 10px; color: #111; background: #343845; overflow: hidden; cursor: default; }
.sdvg-tl-cell.pending { color: #7d8394; }
.sdvg-tl-cell.current { box-shadow: inset 0 0 0 1px #ffffffb0; }
.sdvg-tl-cell.hover { box-shadow: inset 0 0 0 2px #fff; }
.sdvg-tl-chart { position: relative; height: ${CHART_H}px; background: #14161b; border-radius: 3px; overflow: hidden; }
.sdvg-tl-tau { position: absolute; left: 0; right: 0; height: 0; border-top: 1px dashed #e0c04a; }
.sdvg-tl-tau span { position: absolute; right: 3px; top: -12px; font-size: 9px; color: #e0c04a; pointer-events: none; }
.sdvg-tl-col { position: absolute; top: 0; bottom: 0; }
.sdvg-tl-col.hover { background: #ffffff10; }
.sdvg-tl-dot { position: absolute; width: 9px; height: 9px; margin: -5px 0 0 -5px; border-radius: 50%;
  border: 1px solid #0008; }
.sdvg-tl-dot.forced { border-radius: 2px; width: 7px; height: 7px; margin: -4px 0 0 -4px; opacity: 0.8; }
.sdvg-tl-detail { display: flex; gap: 6px; height: ${DETAIL_H}px; overflow: hidden; }
.sdvg-tl-thumb { flex: 0 0 auto; height: ${DETAIL_H}px; max-width: 80px; object-fit: contain; border-radius: 3px;
  display: none; }
.sdvg-tl-thumb.on { display: block; }
.sdvg-tl-lines { flex: 1 1 auto; min-width: 0; display: flex; flex-direction: column; justify-content: center; }
.sdvg-tl-line { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; color: #aeb4c4; }
.sdvg-tl-line.main { color: #e6e8ee; }
.sdvg-tl-line b { font-weight: 600; }
.sdvg-tl-stats.fault { color: #ff7b72; font-weight: 600; }
`;

function ensureStyle() {
  if (document.getElementById(STYLE_ID)) return;
  const style = document.createElement("style");
  style.id = STYLE_ID;
  style.textContent = CSS;
  document.head.appendChild(style);
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function fmt(v, digits = 2) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "string") return v === "inf" ? "+∞" : v === "-inf" ? "−∞" : v; // non-finite from the server
  return Number(v).toFixed(digits);
}

function ms(seconds) {
  const v = Number(seconds);
  return v >= 1 ? `${v.toFixed(2)} s` : `${Math.round(v * 1000)} ms`;
}

// The outcome of a block: from `kind` when the server sent it, else from produced_by / drafted.
export function blockKind(b) {
  if (!b) return null;
  if (b.kind && KINDS[b.kind]) return b.kind;
  if (b.produced_by === "drafter") return "accept";
  if (b.produced_by === "input") return "input";
  return b.drafted ? "reject" : "forced";
}

// Every execution id this canvas node runs under: "12" in the root graph; "5:12" (subgraph node 5 holding
// local node 12), one per instance of the subgraph, nested ids joined by ":".
export function executionIds(node) {
  if (!node) return [];
  const root = node.graph?.rootGraph ?? app.graph;
  if (!node.graph || node.graph === root || node.graph.isRootGraph) return [String(node.id)];
  const out = [];
  const stack = [[root, ""]];
  const seen = new Set();
  while (stack.length) {
    const [graph, prefix] = stack.pop();
    if (!graph || seen.has(graph) || !Array.isArray(graph._nodes)) continue;
    seen.add(graph);
    for (const n of graph._nodes) {
      if (!n.isSubgraphNode?.() || !n.subgraph) continue;
      const p = `${prefix}${n.id}:`;
      if (n.subgraph === node.graph) out.push(`${p}${node.id}`);
      stack.push([n.subgraph, p]);
    }
  }
  return out;
}

// Does a server-side id (node / display_node of our events, nodeId / displayNodeId of previews) point here?
export function matchesNode(node, detail) {
  if (!node || !detail) return false;
  const mine = new Set(executionIds(node));
  return [detail.display_node, detail.node, detail.displayNodeId, detail.nodeId]
    .filter((x) => x !== undefined && x !== null)
    .some((id) => mine.has(String(id)));
}

class Timeline {
  constructor(node) {
    this.node = node;
    this.blocks = [];
    this.thumbs = new Map(); // block -> object URL of its preview
    this.pendingPreviewBlock = null;
    this.numBlocks = 0;
    this.tau = null;
    this.hovered = null;

    this.root = el("div", "sdvg-tl");
    this.root.dataset.sdvgNode = String(node.id);
    const head = el("div", "sdvg-tl-head");
    this.title = el("span", "sdvg-tl-title", "SDVG timeline");
    this.stats = el("span", "sdvg-tl-stats", "run the workflow to fill it");
    head.append(this.title, this.stats);
    const legend = el("div", "sdvg-tl-legend");
    for (const [kind, { label, color }] of Object.entries(KINDS)) {
      const item = el("span", "sdvg-tl-legend-" + kind);
      const swatch = el("i");
      swatch.style.background = color;
      item.append(swatch, document.createTextNode(label));
      legend.append(item);
    }
    this.cells = el("div", "sdvg-tl-cells");
    this.chart = el("div", "sdvg-tl-chart");
    this.detail = el("div", "sdvg-tl-detail");
    this.thumb = el("img", "sdvg-tl-thumb");
    this.thumb.alt = "block frames";
    const lines = el("div", "sdvg-tl-lines");
    this.line1 = el("div", "sdvg-tl-line main", "");
    this.line2 = el("div", "sdvg-tl-line", "");
    this.line3 = el("div", "sdvg-tl-line", "");
    lines.append(this.line1, this.line2, this.line3);
    this.detail.append(this.thumb, lines);
    this.root.append(head, legend, this.cells, this.chart, this.detail);
    this.root.addEventListener("mouseleave", () => this.hover(null));

    this.handlers = {
      "sdvg.start": (e) => this.onStart(e.detail),
      "sdvg.block": (e) => this.onBlock(e.detail),
      "sdvg.preview": (e) => this.onPreviewBlock(e.detail),
      "sdvg.done": (e) => this.onDone(e.detail),
      b_preview_with_metadata: (e) => this.onPreview(e.detail),
    };
    for (const [name, fn] of Object.entries(this.handlers)) api.addEventListener(name, fn);
    this.render();
  }

  dispose() {
    for (const [name, fn] of Object.entries(this.handlers)) api.removeEventListener(name, fn);
    this.handlers = {};
    this.clearThumbs();
    this.root.remove();
  }

  clearThumbs() {
    for (const url of this.thumbs.values()) URL.revokeObjectURL(url);
    this.thumbs.clear();
    this.thumb.removeAttribute("src");
  }

  rows() {
    const n = Math.max(this.numBlocks, this.blocks.length, 1);
    return Math.ceil(n / MAX_COLS);
  }

  // Height the widget needs; the node's own preview (latest block's frames) gets the rest of the node.
  height() {
    const rows = this.rows();
    return 12 + 15 + 13 + rows * CELL_H + (rows - 1) * 2 + CHART_H + DETAIL_H + 4 * 5 + 2;
  }

  onStart(d) {
    if (!matchesNode(this.node, d)) return;
    this.runId = d.run || null;
    this.blocks = [];
    this.clearThumbs();
    this.pendingPreviewBlock = null;
    this.hovered = null;
    const rowsBefore = this.rows();
    this.numBlocks = Number(d.num_blocks) || 0;
    this.tau = typeof d.tau === "number" ? d.tau : null;
    this.mode = d.mode || null;
    if (this.rows() > rowsBefore) this.growNode();
    this.title.textContent = `SDVG 0/${this.numBlocks}`;
    this.showFault(null);
    this.stats.textContent = this.mode ? `mode ${this.mode}` + (this.tau !== null ? `, τ ${fmt(this.tau)}` : "") : "";
    this.render();
  }

  onBlock(d) {
    if (!matchesNode(this.node, d) || !Number.isInteger(d.block) || d.block < 0 || d.block > 4096) return;
    this.numBlocks = Math.max(this.numBlocks, Number(d.num_blocks) || 0);
    if (typeof d.tau === "number") this.tau = d.tau;
    this.blocks[d.block] = d;
    this.title.textContent = `SDVG ${this.done().length}/${this.numBlocks}`;
    this.stats.textContent = this.acceptanceText();
    this.render();
  }

  onPreviewBlock(d) {
    if (!matchesNode(this.node, d)) return;
    this.pendingPreviewBlock = Number.isInteger(d.block) ? d.block : null;
  }

  onPreview(d) {
    if (!d || !d.blob || this.pendingPreviewBlock === null) return;
    if (!matchesNode(this.node, { nodeId: d.nodeId, displayNodeId: d.displayNodeId })) return;
    const block = this.pendingPreviewBlock;
    this.pendingPreviewBlock = null;
    const old = this.thumbs.get(block);
    if (old) URL.revokeObjectURL(old);
    this.thumbs.set(block, URL.createObjectURL(d.blob));
    if (this.hovered === block) this.showDetail(block);
  }

  // The node's ui output (sent on execution, again when the node is cached, and kept in the history): the whole
  // timeline of one run, so the widget comes back after a reload or a fully cached run.
  restore(summary) {
    if (!summary || !Array.isArray(summary.blocks)) return;
    if (summary.run !== this.runId) {
      this.clearThumbs(); // another run's frames must not show on these cells
      this.runId = summary.run || null;
    }
    const rowsBefore = this.rows();
    this.numBlocks = Number(summary.num_blocks) || 0;
    this.tau = typeof summary.tau === "number" ? summary.tau : null;
    this.mode = summary.mode || null;
    this.blocks = [];
    for (const b of summary.blocks) {
      if (b && Number.isInteger(b.block) && b.block >= 0 && b.block <= 4096) this.blocks[b.block] = b;
    }
    if (this.rows() > rowsBefore) this.growNode();
    this.title.textContent = `SDVG ${this.done().length}/${this.numBlocks}`;
    this.onDone({ node: this.node.id, totals: summary.totals, wall_s: summary.wall_s, fault: summary.fault }, true);
    this.render();
  }

  onDone(d, trusted = false) {
    if (!trusted && !matchesNode(this.node, d)) return;
    const t = d.totals || {};
    const parts = [this.acceptanceText()];
    if (typeof t.speedup_est === "number") parts.push(`≈${t.speedup_est.toFixed(2)}× vs target`);
    if (typeof d.wall_s === "number") parts.push(`${d.wall_s.toFixed(1)} s`);
    this.stats.textContent = parts.filter(Boolean).join(" · ");
    this.showFault(typeof d.fault === "string" ? d.fault : null);
  }

  // A fault that kept the finished blocks (on_fault: keep finished blocks): the error, in red, on the node.
  showFault(message) {
    this.stats.classList.toggle("fault", Boolean(message));
    this.stats.title = message || "";
    if (message) this.stats.textContent = `⚠ ${message} (kept ${this.done().length} block(s))`;
  }

  done() {
    return this.blocks.filter(Boolean);
  }

  // More rows of cells than before: make the node tall enough (never shrink what the user sized).
  growNode() {
    const need = this.node.computeSize?.();
    if (need && this.node.size && need[1] > this.node.size[1]) this.node.setSize?.([this.node.size[0], need[1]]);
  }

  acceptanceText() {
    const done = this.done();
    const drafted = done.filter((b) => blockKind(b) !== "forced" && blockKind(b) !== "input");
    const accepted = done.filter((b) => blockKind(b) === "accept");
    if (!drafted.length) return done.length ? "no drafts" : "";
    return `accepted ${accepted.length}/${drafted.length} drafts (${Math.round((100 * accepted.length) / drafted.length)}%)`;
  }

  latest() {
    for (let i = this.blocks.length - 1; i >= 0; i--) if (this.blocks[i]) return i;
    return null;
  }

  hover(block) {
    this.hovered = block;
    for (const c of this.cells.children) c.classList.toggle("hover", c.dataset.block === String(block));
    for (const c of this.chart.querySelectorAll(".sdvg-tl-col")) c.classList.toggle("hover", c.dataset.block === String(block));
    this.showDetail(block ?? this.latest());
  }

  showDetail(i) {
    const b = i === null || i === undefined ? null : this.blocks[i];
    if (!b) {
      this.line1.textContent = this.numBlocks ? "waiting for the first block…" : "One cell per block; hover for details.";
      this.line2.textContent = "";
      this.line3.textContent = "";
      this.detail.title = "";
      this.thumb.classList.remove("on");
      return;
    }
    const kind = blockKind(b);
    this.line1.replaceChildren();
    const head = el("b", "", `block ${b.block}`);
    head.style.color = KINDS[kind].color;
    this.line1.append(head, document.createTextNode(` ${KINDS[kind].label} — ${b.reason || b.decision || ""}`));
    const stats = b.frame_stats;
    const frames = stats ? `frames min ${fmt(stats.min)} / mean ${fmt(stats.mean)} (${stats.count})` : "no frame scores";
    const q = (kind === "forced" || kind === "input") && (b.q === null || b.q === undefined) ? "not scored" : `q_b ${fmt(b.q)}`;
    this.line2.textContent = `${q} · τ ${fmt(b.tau)}${b.aggregation ? ` (${b.aggregation})` : ""} · ${frames}`;
    const times = Object.entries(b.timings || {})
      .filter(([, v]) => typeof v === "number")
      .map(([k, v]) => `${k} ${ms(v)}`);
    this.line3.textContent = times.length ? times.join(" · ") : "";
    this.detail.title = [this.line1.textContent, this.line2.textContent, this.line3.textContent].filter(Boolean).join("\n");
    const url = this.hovered === i ? this.thumbs.get(i) : null;
    if (url) {
      this.thumb.src = url;
      this.thumb.classList.add("on");
    } else {
      this.thumb.classList.remove("on");
    }
  }

  render() {
    const n = Math.max(this.numBlocks, this.blocks.length);
    const cols = Math.max(1, Math.min(n || 1, MAX_COLS));
    this.cells.style.gridTemplateColumns = `repeat(${cols}, minmax(0, 1fr))`;
    const latest = this.latest();
    this.cells.replaceChildren();
    for (let i = 0; i < n; i++) {
      const b = this.blocks[i];
      const kind = blockKind(b);
      const cell = el("div", "sdvg-tl-cell " + (kind || "pending"), i);
      cell.dataset.block = String(i);
      if (kind) {
        cell.style.background = KINDS[kind].color;
        cell.dataset.kind = kind;
        if (i === latest) cell.classList.add("current");
        cell.addEventListener("mouseenter", () => this.hover(i));
      }
      this.cells.append(cell);
    }
    this.renderChart(n, cols);
    this.showDetail(this.hovered ?? latest);
    this.node.setDirtyCanvas?.(true, false);
  }

  renderChart(n, cols) {
    this.chart.replaceChildren();
    if (!n) return;
    const qs = this.blocks.filter((b) => b && typeof b.q === "number").map((b) => b.q);
    const values = this.tau !== null ? [...qs, this.tau] : qs;
    let lo = values.length ? Math.min(...values) : -1;
    let hi = values.length ? Math.max(...values) : 1;
    const span = Math.max(hi - lo, 0.1);
    lo -= span * 0.2;
    hi += span * 0.2;
    const pad = 7; // px kept free at top and bottom so dots are never cut (q_b values are in the hover details)
    const y = (v) => `calc(${pad}px + (100% - ${2 * pad}px) * ${(hi - v) / (hi - lo)})`;
    const colW = 100 / Math.min(n, cols);
    const x = (i) => (i % cols) * colW;
    if (this.tau !== null) {
      const line = el("div", "sdvg-tl-tau");
      line.style.top = y(this.tau);
      line.append(el("span", "", `τ ${fmt(this.tau)}`));
      this.chart.append(line);
    }
    this.blocks.forEach((b, i) => {
      if (!b) return;
      const kind = blockKind(b);
      const col = el("div", "sdvg-tl-col");
      col.dataset.block = String(i);
      col.style.left = `${x(i)}%`;
      col.style.width = `${colW}%`;
      col.addEventListener("mouseenter", () => this.hover(i));
      const dot = el("div", "sdvg-tl-dot " + kind);
      dot.style.left = "50%";
      dot.style.background = KINDS[kind].color;
      // a block that was not scored (forced) sits on the baseline as a small square
      dot.style.top = typeof b.q === "number" ? y(b.q) : `calc(100% - ${pad}px)`;
      col.append(dot);
      this.chart.append(col);
    });
  }
}

function chain(object, method, fn) {
  const original = object[method];
  object[method] = function (...args) {
    const r = original?.apply(this, args);
    fn.apply(this, args);
    return r;
  };
}

app.registerExtension({
  name: EXT_NAME,
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_TYPE) return;
    ensureStyle();
    chain(nodeType.prototype, "onNodeCreated", function () {
      const timeline = new Timeline(this);
      this.sdvgTimeline = timeline;
      const widget = this.addDOMWidget("sdvg_timeline", "sdvg-timeline", timeline.root, {
        serialize: false,
        hideOnZoom: false,
        margin: MARGIN,
        // the widget's height includes the margin on both sides of the element
        getMinHeight: () => timeline.height() + 2 * MARGIN,
        getMaxHeight: () => timeline.height() + 2 * MARGIN,
      });
      widget.serialize = false; // never part of widgets_values
      timeline.widget = widget;
    });
    chain(nodeType.prototype, "onExecuted", function (output) {
      this.sdvgTimeline?.restore(output?.sdvg_timeline?.[0]);
    });
    chain(nodeType.prototype, "onRemoved", function () {
      this.sdvgTimeline?.dispose();
      this.sdvgTimeline = null;
    });
  },
  async setup() {
    window.__sdvgTimeline = { loaded: true, version: 3, kinds: Object.keys(KINDS) };
  },
});
