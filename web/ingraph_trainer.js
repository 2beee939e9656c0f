// InGraph Trainer: a live panel on the Train LoRA and Distill nodes (progress, loss chart, lr, speed, ETA, Stop;
// a distillation's fake-score loss as a second series).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { Series, Smoother, drawChart } from "./ingraph_chart.js";

const PANEL_NODES = new Set(["InGraphTrainLoRA", "InGraphDistill"]); // nodes that run the trainer
const EVENTS_PAGE = 10000; // events per request when a reload rebuilds a run's history
const SAMPLE_IMAGES = 16; // the newest preview images a panel keeps
const panels = new Map(); // node id (string) -> Panel

function fmtTime(s) {
  if (s == null || !isFinite(s)) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

// a number from an event (null where it was not finite) as text
const fixed = (v, digits) => (typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "–");
const exponential = (v, digits) => (typeof v === "number" && isFinite(v) ? v.toExponential(digits) : "–");

export class Panel {
  constructor(node) {
    this.node = node;
    const el = (this.el = document.createElement("div"));
    el.className = "ingraph-panel";
    el.style.cssText = "display:flex;flex-direction:column;gap:4px;padding:4px;font:11px sans-serif;color:#ddd;" +
      "background:#1c1c20;border-radius:6px;box-sizing:border-box;width:100%;height:100%;overflow:hidden";
    el.innerHTML = `
      <div style="display:flex;align-items:center;gap:6px">
        <div style="flex:1;height:8px;background:#333;border-radius:4px;overflow:hidden">
          <div data-role="bar" style="height:100%;width:0;background:#4a9eff"></div></div>
        <span data-role="step">idle</span>
        <button data-role="stop" disabled title="Save a checkpoint, write the LoRA and end the run cleanly (ComfyUI's Cancel ends it at once)"
          style="font-size:11px;padding:1px 8px;border-radius:4px;border:1px solid #666;background:#402020;color:#eee;cursor:pointer">Stop</button>
      </div>
      <div data-role="stats" style="display:grid;grid-template-columns:repeat(4,auto);gap:2px 10px;white-space:nowrap">
        <span>loss <b data-role="loss">–</b></span><span>lr <b data-role="lr">–</b></span>
        <span><b data-role="speed">–</b> img/s</span><span>ETA <b data-role="eta">–</b></span>
        <span data-role="fake-stat" style="display:none;color:#d98cff" title="the fake score's loss (distillation)">fake loss <b data-role="fake">–</b></span>
      </div>
      <canvas data-role="chart" data-points="0" data-evals="0" data-fake="0" data-drawn="0" style="width:100%;flex:1;min-height:90px;background:#151518;border-radius:4px"></canvas>
      <div style="display:flex;align-items:center;gap:6px">
        <div data-role="state" style="flex:1;min-width:0;color:#aaa;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;user-select:text"></div>
        <button data-role="copy" style="display:none;font-size:10px;padding:0 6px;border-radius:4px;border:1px solid #555;background:#2a2a30;color:#ccc;cursor:pointer">copy path</button>
      </div>
      <div data-role="plan" style="color:#888;font-size:11px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis"></div>
      <div data-role="samples" style="display:flex;gap:4px;overflow-x:auto"></div>`;
    this.$ = (role) => el.querySelector(`[data-role="${role}"]`);
    this.$("stop").addEventListener("click", () => this.stop());
    this.$("copy").addEventListener("click", () => this.copyPath());
    // drawn at the size the canvas has on screen: a panel drawn before the node was laid out (a reopened graph
    // restoring a finished run gets no later event) would otherwise stay a stretched, blurred 100-pixel chart.
    // Only a change of the on-screen size redraws (a redraw sets the canvas's own size, which must not loop)
    if (typeof ResizeObserver === "function") {
      this.resized = new ResizeObserver(() => {
        const c = this.$("chart");
        if (c.clientWidth !== this.drawnWidth || c.clientHeight !== this.drawnHeight) this.invalidate();
      });
      this.resized.observe(this.$("chart"));
    }
    this.loss = new Series(); this.smooth = new Series(); this.evals = new Series(); this.smoother = new Smoother();
    this.fake = new Series(); // a distillation's fake-score loss
    this.reset();
  }

  // a new run shows nothing of the previous one; memory per run is bounded (series buckets, a few images)
  reset() {
    this.runId = null; this.state = "idle"; this.total = null; this.lastStep = null; this.lastEval = -1;
    this.loss.clear(); this.smooth.clear(); this.evals.clear(); this.smoother.clear(); this.fake.clear();
    this.samples = []; // [{key, src, title}] newest last
    this.message = ""; this.stepText = "starting";
    this.plan = ""; // the memory plan of the run (its started event): what the device holds at the peak
    this.latest = null; // the newest step event
    this.path = ""; // the finished run's adapter file, for "copy path"
    this.invalidate();
  }

  async stop() {
    if (!this.runId) return;
    this.$("stop").disabled = true;
    this.$("state").textContent = "stop requested: saving a checkpoint…";
    await api.fetchApi(`/ingraph/runs/${encodeURIComponent(this.runId)}/stop`, { method: "POST" });
  }

  // the adapter's path to the clipboard; where the page may not write it (plain http to another machine), the
  // path is selected in the state line for Ctrl+C
  async copyPath() {
    if (!this.path) return;
    const copy = this.$("copy");
    try {
      await navigator.clipboard.writeText(this.path);
      copy.textContent = "copied";
    } catch (e) {
      const range = document.createRange();
      range.selectNodeContents(this.$("state")); // the path is the line's end: Ctrl+C copies the line
      const selection = window.getSelection();
      selection.removeAllRanges(); selection.addRange(range);
      copy.textContent = "Ctrl+C";
    }
    setTimeout(() => { copy.textContent = "copy path"; }, 2000);
  }

  handle(runId, event) {
    if (this.buffer) { this.buffer.push([runId, event]); return; } // a restore is replaying history
    this.apply(runId, event);
  }

  apply(runId, event) {
    // a new run starts a new chart; a resumed run continues the chart of the same run, unless it went back to
    // an older checkpoint than the last step drawn (another timeline: its steps would be dropped as replayed)
    if (event.type === "started" && (runId !== this.runId || !(event.start_step > 0) ||
        (this.lastStep != null && event.start_step < this.lastStep))) this.reset();
    this.runId = runId;
    switch (event.type) {
      case "started":
        this.state = "running"; this.total = event.total; this.path = ""; // a resumed run writes its file again
        this.message = `run ${runId}` + (event.resumed_from ? ` (resumed at step ${event.start_step})` : "");
        this.plan = typeof event.memory_plan?.summary === "string" ? event.memory_plan.summary : "";
        break;
      case "step": {
        if (typeof event.step !== "number" || (this.lastStep != null && event.step <= this.lastStep)) break; // replayed already
        this.state = "running"; this.total = event.total; this.lastStep = event.step; this.latest = event;
        this.loss.push(event.step, event.loss);
        if ("fake_loss" in event) this.fake.push(event.step, event.fake_loss);
        const smoothed = this.smoother.push(event.loss);
        if (smoothed != null) this.smooth.push(event.step, smoothed);
        break;
      }
      case "eval":
        if (typeof event.step !== "number" || event.step <= this.lastEval) break; // replayed already
        this.lastEval = event.step;
        this.evals.push(event.step, event.loss);
        break;
      case "checkpoint":
        this.message = `checkpoint at step ${event.step}`;
        break;
      case "sample": {
        // images are files of the run directory ("samples/step000020_0.png"), served by the pack's route
        (event.images || []).forEach((path, i) => {
          const key = `${runId}:${path}`;
          if (typeof path !== "string" || this.samples.some((s) => s.key === key)) return; // replayed already
          this.samples.push({
            key, title: `step ${event.step}: ${(event.prompts || [])[i] ?? ""}`, step: String(event.step),
            src: api.apiURL(`/ingraph/runs/${encodeURIComponent(runId)}/${path.split("/").map(encodeURIComponent).join("/")}`),
          });
        });
        if (this.samples.length > SAMPLE_IMAGES) this.samples.splice(0, this.samples.length - SAMPLE_IMAGES);
        break;
      }
      case "finished":
        this.state = event.stopped ? "stopped" : "finished";
        this.path = typeof event.adapter === "string" ? event.adapter : "";
        this.message = `${this.state} at step ${event.steps}: ${this.path}`;
        break;
      case "error":
        this.state = "failed";
        this.message = `error: ${event.message}`;
        break;
    }
    this.invalidate();
  }

  // one render per animation frame however many events arrived (a reload replays a whole run at once)
  invalidate() {
    if (this.replaying || this.pending) return;
    this.pending = true;
    const frame = window.requestAnimationFrame || ((f) => setTimeout(f, 16));
    frame(() => { this.pending = false; this.render(); });
  }

  render() {
    if (!this.el) return;
    const e = this.latest;
    if (e && this.lastStep != null) {
      this.$("bar").style.width = `${Math.min(100, (100 * e.step) / (e.total || e.step || 1))}%`;
      this.$("step").textContent = `${e.step} / ${e.total}`;
      this.$("loss").textContent = fixed(e.loss, 4);
      this.$("lr").textContent = exponential(e.lr, 2);
      this.$("speed").textContent = fixed(e.samples_per_s, 1);
      this.$("eta").textContent = fmtTime(e.eta_s);
      this.$("fake").textContent = fixed(e.fake_loss, 4);
    } else {
      this.$("bar").style.width = "0";
      this.$("step").textContent = this.stepText;
      for (const role of ["loss", "lr", "speed", "eta", "fake"]) this.$(role).textContent = "–";
    }
    this.$("fake-stat").style.display = this.latest && "fake_loss" in this.latest ? "" : "none";
    this.$("state").textContent = this.message;
    this.$("state").title = this.message; // the whole line, where the panel is too narrow for it
    const copy = this.$("copy");
    copy.style.display = this.path ? "" : "none";
    copy.title = this.path ? `copy ${this.path}` : "";
    this.$("plan").textContent = this.plan; this.$("plan").title = this.plan;
    const stop = this.$("stop");
    stop.disabled = this.state !== "running";
    stop.style.opacity = stop.disabled ? "0.4" : "1";
    stop.style.cursor = stop.disabled ? "default" : "pointer";
    this.renderSamples();
    this.draw();
  }

  renderSamples() {
    const box = this.$("samples");
    const wanted = new Set(this.samples.map((s) => s.key));
    for (const img of [...box.children]) if (!wanted.has(img.dataset.key)) img.remove();
    const shown = new Set([...box.children].map((img) => img.dataset.key));
    for (const s of this.samples) { // newest first
      if (shown.has(s.key)) continue;
      const img = document.createElement("img");
      img.src = s.src; img.title = s.title; img.dataset.key = s.key; img.dataset.step = s.step;
      img.style.cssText = "height:64px;border-radius:3px;image-rendering:pixelated";
      box.prepend(img);
    }
  }

  draw() {
    const canvas = this.$("chart");
    const dpr = window.devicePixelRatio || 1; // sharp lines and text on high-density screens
    this.drawnWidth = canvas.clientWidth; this.drawnHeight = canvas.clientHeight;
    const w = Math.max(100, canvas.clientWidth), h = Math.max(60, canvas.clientHeight);
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    canvas.dataset.points = String(this.loss.count);
    canvas.dataset.evals = String(this.evals.count);
    canvas.dataset.fake = String(this.fake.count);
    canvas.dataset.drawn = String(drawChart(ctx, w, h, this));
  }

  // after a page reload: rebuild the history of this node's newest run from the run record, page by page
  async restore() {
    this.buffer = []; // live events that arrive meanwhile are applied after the history
    try {
      const runs = (await (await api.fetchApi("/ingraph/runs")).json()).runs || [];
      const mine = runs.filter((r) => r.node === String(this.node.id));
      const run = mine.find((r) => r.state === "running") || mine[0];
      let since = 0;
      this.replaying = true;
      while (run && !this.buffer.some(([id, e]) => id !== run.id && e.type === "started")) {
        const url = `/ingraph/runs/${encodeURIComponent(run.id)}/events?since=${since}&limit=${EVENTS_PAGE}`;
        const page = await (await api.fetchApi(url)).json();
        for (const event of page.events || []) this.apply(run.id, event);
        if (!(page.next > since) || !(page.events || []).length) break;
        since = page.next;
      }
    } catch (e) {
      console.warn("InGraph Trainer: could not restore the run history", e);
    }
    this.replaying = false;
    const live = this.buffer;
    this.buffer = null;
    for (const [id, event] of live) this.apply(id, event); // duplicates of the history are skipped
    this.invalidate();
  }
}

app.registerExtension({
  name: "ingraph.trainer.panel",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!PANEL_NODES.has(nodeData.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const panel = new Panel(this);
      this.addDOMWidget("training_panel", "ingraph_panel", panel.el, { serialize: false, getMinHeight: () => 200 });
      this.ingraphPanel = panel;
      this.setSize([Math.max(this.size[0], 420), this.size[1] + 210]);
      setTimeout(() => { panels.set(String(this.id), panel); panel.restore(); }, 0);
      return result;
    };
    const onRemoved = nodeType.prototype.onRemoved;
    nodeType.prototype.onRemoved = function () {
      panels.delete(String(this.id));
      this.ingraphPanel?.resized?.disconnect();
      return onRemoved?.apply(this, arguments);
    };
  },
  setup() {
    api.addEventListener("ingraph.event", ({ detail }) => {
      if (!detail) return;
      let panel = panels.get(String(detail.node));
      if (!panel) {
        const node = app.graph?.getNodeById?.(Number(detail.node));
        panel = node?.ingraphPanel;
        if (panel) panels.set(String(detail.node), panel);
      }
      panel?.handle(detail.run_id, detail.event);
    });
  },
});
