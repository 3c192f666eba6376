// SDVG timeline widget for the SDVG Speculative Sampler node.
//
// Listens to the pack's websocket events (sdvg.start / sdvg.block / sdvg.done) and to the node's block
// previews (b_preview_with_metadata), and draws: one cell per block (green = draft accepted, amber = target
// generated), a q_b-vs-τ strip with hover details, and the latest block's frames. Widget state is never
// serialized into the workflow. All text goes through textContent (no innerHTML with server data).

const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

const NODE_TYPE = "SDVGSpeculativeSampler";
const EXT_NAME = "sdvg.timeline";
const STYLE_ID = "sdvg-timeline-style";

const CSS = `
.sdvg-tl { display: flex; flex-direction: column; gap: 4px; font: 11px sans-serif; color: #ddd;
  background: #1d1f26; border-radius: 6px; padding: 6px; box-sizing: border-box; width: 100%; height: 100%;
  overflow: hidden; }
.sdvg-tl-head { display: flex; justify-content: space-between; gap: 8px; white-space: nowrap; overflow: hidden; }
.sdvg-tl-cells { display: flex; gap: 2px; min-height: 18px; flex-wrap: wrap; }
.sdvg-tl-cell { flex: 0 0 auto; min-width: 18px; height: 18px; border-radius: 3px; text-align: center;
  line-height: 18px; font-size: 10px; color: #111; cursor: default; }
.sdvg-tl-cell.accept { background: #4fbf7a; }
.sdvg-tl-cell.target { background: #eca93c; }
.sdvg-tl-cell.pending { background: #3a3d48; color: #888; }
.sdvg-tl-chart { position: relative; height: 46px; background: #15171c; border-radius: 3px; }
.sdvg-tl-tau { position: absolute; left: 0; right: 0; border-top: 1px dashed #e05a5a; }
.sdvg-tl-dot { position: absolute; width: 7px; height: 7px; margin: -3px 0 0 -3px; border-radius: 50%; }
.sdvg-tl-detail { min-height: 14px; color: #aab; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.sdvg-tl-frames { flex: 1 1 auto; min-height: 40px; display: flex; align-items: center; justify-content: center; }
.sdvg-tl-frames img { max-width: 100%; max-height: 100%; object-fit: contain; border-radius: 3px; }
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
  if (typeof v === "string") return v; // "inf" / "-inf" from the server
  return Number(v).toFixed(digits);
}

// Does a server-side execution id ("12" or "5:12" inside a subgraph) point at this canvas node?
export function matchesNode(node, detail) {
  if (!node || !detail) return false;
  const own = String(node.id);
  const ids = [detail.node, detail.display_node, detail.nodeId, detail.displayNodeId]
    .filter((x) => x !== undefined && x !== null)
    .map(String);
  const inRoot = !node.graph || node.graph === app.graph || node.graph.isRootGraph;
  for (const id of ids) {
    if (inRoot ? id === own : id === own || id.endsWith(":" + own)) return true;
  }
  return false;
}

class Timeline {
  constructor(node) {
    this.node = node;
    this.blocks = [];
    this.numBlocks = 0;
    this.tau = null;
    this.imageUrl = null;
    this.root = el("div", "sdvg-tl");
    this.root.dataset.sdvgNode = String(node.id);
    this.head = el("div", "sdvg-tl-head");
    this.title = el("span", "", "SDVG timeline: waiting for a run");
    this.stats = el("span", "", "");
    this.head.append(this.title, this.stats);
    this.cells = el("div", "sdvg-tl-cells");
    this.chart = el("div", "sdvg-tl-chart");
    this.detail = el("div", "sdvg-tl-detail", "");
    this.frames = el("div", "sdvg-tl-frames");
    this.img = el("img");
    this.img.alt = "latest block";
    this.frames.append(this.img);
    this.root.append(this.head, this.cells, this.chart, this.detail, this.frames);
    this.handlers = {
      "sdvg.start": (e) => this.onStart(e.detail),
      "sdvg.block": (e) => this.onBlock(e.detail),
      "sdvg.done": (e) => this.onDone(e.detail),
      b_preview_with_metadata: (e) => this.onPreview(e.detail),
    };
    for (const [name, fn] of Object.entries(this.handlers)) api.addEventListener(name, fn);
  }

  dispose() {
    for (const [name, fn] of Object.entries(this.handlers)) api.removeEventListener(name, fn);
    this.handlers = {};
    if (this.imageUrl) URL.revokeObjectURL(this.imageUrl);
    this.imageUrl = null;
    this.root.remove();
  }

  onStart(d) {
    if (!matchesNode(this.node, d)) return;
    this.blocks = [];
    this.numBlocks = Number(d.num_blocks) || 0;
    this.tau = typeof d.tau === "number" ? d.tau : null;
    this.title.textContent = `SDVG: 0/${this.numBlocks} blocks`;
    this.stats.textContent = d.mode ? `mode ${d.mode}` : "";
    this.detail.textContent = "";
    this.render();
  }

  onBlock(d) {
    if (!matchesNode(this.node, d)) return;
    this.numBlocks = Math.max(this.numBlocks, Number(d.num_blocks) || 0);
    if (typeof d.tau === "number") this.tau = d.tau;
    this.blocks[d.block] = d;
    const done = this.blocks.filter(Boolean);
    const drafted = done.filter((b) => b.produced_by === "drafter" || b.decision === "accept" || b.decision === "reject");
    const accepted = done.filter((b) => b.produced_by === "drafter");
    this.title.textContent = `SDVG: ${done.length}/${this.numBlocks} blocks`;
    this.stats.textContent = drafted.length ? `accepted ${accepted.length}/${drafted.length}` : "";
    this.showDetail(d);
    this.render();
  }

  onDone(d) {
    if (!matchesNode(this.node, d)) return;
    const t = d.totals || {};
    const parts = [];
    if (typeof t.acceptance === "number") parts.push(`acceptance ${(100 * t.acceptance).toFixed(0)}%`);
    if (typeof t.speedup_est === "number") parts.push(`~${t.speedup_est.toFixed(2)}× vs target-only`);
    if (typeof d.wall_s === "number") parts.push(`${d.wall_s.toFixed(1)} s`);
    this.stats.textContent = parts.join(" · ");
  }

  onPreview(d) {
    if (!d || !d.blob || !matchesNode(this.node, { nodeId: d.nodeId, displayNodeId: d.displayNodeId })) return;
    if (this.imageUrl) URL.revokeObjectURL(this.imageUrl);
    this.imageUrl = URL.createObjectURL(d.blob);
    this.img.src = this.imageUrl;
  }

  showDetail(b) {
    const who = b.produced_by === "drafter" ? "draft accepted" : b.decision === "reject" ? "target regenerated" : "target";
    const scores = (b.scores || []).map((s) => fmt(s)).join(" ");
    const times = Object.entries(b.timings || {}).map(([k, v]) => `${k} ${fmt(v, 2)}s`).join(", ");
    this.detail.textContent = `block ${b.block}: ${who} (${b.reason || "–"}) q=${fmt(b.q)} τ=${fmt(b.tau)}` +
      (scores ? ` | frames ${scores}` : "") + (times ? ` | ${times}` : "");
  }

  render() {
    this.cells.replaceChildren();
    const n = Math.max(this.numBlocks, this.blocks.length);
    for (let i = 0; i < n; i++) {
      const b = this.blocks[i];
      const cell = el("div", "sdvg-tl-cell " + (!b ? "pending" : b.produced_by === "drafter" ? "accept" : "target"), i);
      cell.dataset.block = String(i);
      if (b) {
        cell.title = `block ${i}: ${b.decision} by ${b.produced_by}, q=${fmt(b.q)}, τ=${fmt(b.tau)}`;
        cell.addEventListener("mouseenter", () => this.showDetail(b));
      }
      this.cells.append(cell);
    }
    this.renderChart(n);
    this.node.setDirtyCanvas?.(true, false);
  }

  renderChart(n) {
    this.chart.replaceChildren();
    const qs = this.blocks.filter((b) => b && typeof b.q === "number").map((b) => b.q);
    if (this.tau !== null) qs.push(this.tau);
    if (!qs.length || !n) return;
    let lo = Math.min(...qs), hi = Math.max(...qs);
    if (hi - lo < 0.5) { lo -= 0.25; hi += 0.25; }
    const y = (v) => `${(100 * (hi - v)) / (hi - lo)}%`;
    if (this.tau !== null) {
      const line = el("div", "sdvg-tl-tau");
      line.style.top = y(this.tau);
      line.title = `τ = ${fmt(this.tau)}`;
      this.chart.append(line);
    }
    this.blocks.forEach((b, i) => {
      if (!b || typeof b.q !== "number") return;
      const dot = el("div", "sdvg-tl-dot");
      dot.style.left = `${(100 * (i + 0.5)) / n}%`;
      dot.style.top = y(b.q);
      dot.style.background = b.produced_by === "drafter" ? "#4fbf7a" : "#eca93c";
      dot.title = `block ${i}: q=${fmt(b.q)} (${b.decision})`;
      dot.addEventListener("mouseenter", () => this.showDetail(b));
      this.chart.append(dot);
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
        getMinHeight: () => 220,
      });
      widget.serialize = false; // never part of widgets_values
      widget.computeLayoutSize = () => ({ minHeight: 220, minWidth: 300 });
    });
    chain(nodeType.prototype, "onRemoved", function () {
      this.sdvgTimeline?.dispose();
      this.sdvgTimeline = null;
    });
  },
  async setup() {
    window.__sdvgTimeline = { loaded: true, version: 1 };
  },
});
