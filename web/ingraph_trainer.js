// InGraph Trainer: a live panel on the Train LoRA node (progress, loss chart, lr, speed, ETA, Stop).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TRAIN_NODE = "InGraphTrainLoRA";
const panels = new Map(); // node id (string) -> Panel

function fmtTime(s) {
  if (s == null || !isFinite(s)) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

function smooth(values, beta = 0.9) {
  let avg = 0;
  return values.map((v, i) => { avg = beta * avg + (1 - beta) * v; return avg / (1 - Math.pow(beta, i + 1)); });
}

class Panel {
  constructor(node) {
    this.node = node;
    this.reset();
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
      </div>
      <canvas data-role="chart" data-points="0" data-evals="0" style="width:100%;flex:1;min-height:90px;background:#151518;border-radius:4px"></canvas>
      <div data-role="state" style="color:#aaa;white-space:nowrap;overflow:hidden;text-overflow:ellipsis"></div>
      <div data-role="samples" style="display:flex;gap:4px;overflow-x:auto"></div>`;
    this.$ = (role) => el.querySelector(`[data-role="${role}"]`);
    this.$("stop").addEventListener("click", () => this.stop());
  }

  reset() {
    this.runId = null; this.steps = []; this.losses = []; this.evals = []; this.state = "idle"; this.seen = 0;
    if (this.el) { // a new run shows nothing of the previous one
      this.$("samples").replaceChildren();
      this.$("bar").style.width = "0";
      this.$("step").textContent = "starting";
      for (const role of ["loss", "lr", "speed", "eta"]) this.$(role).textContent = "–";
    }
  }

  async stop() {
    if (!this.runId) return;
    this.$("stop").disabled = true;
    this.$("state").textContent = "stop requested: saving a checkpoint…";
    await api.fetchApi(`/ingraph/runs/${encodeURIComponent(this.runId)}/stop`, { method: "POST" });
  }

  handle(runId, event) {
    if (this.buffer) { this.buffer.push([runId, event]); return; } // a restore is replaying history
    // a new run starts a new chart; a resumed run continues the chart of the same run
    if (event.type === "started" && (runId !== this.runId || !(event.start_step > 0))) this.reset();
    this.runId = runId;
    switch (event.type) {
      case "started":
        this.state = "running"; this.total = event.total;
        this.$("state").textContent = `run ${runId}` + (event.resumed_from ? ` (resumed at step ${event.start_step})` : "");
        break;
      case "step":
        if (this.steps.length && event.step <= this.steps[this.steps.length - 1]) break; // replayed already
        this.state = "running"; this.total = event.total;
        this.steps.push(event.step); this.losses.push(event.loss);
        this.$("bar").style.width = `${(100 * event.step) / event.total}%`;
        this.$("step").textContent = `${event.step} / ${event.total}`;
        this.$("loss").textContent = event.loss.toFixed(4);
        this.$("lr").textContent = Number(event.lr).toExponential(2);
        this.$("speed").textContent = event.samples_per_s.toFixed(1);
        this.$("eta").textContent = fmtTime(event.eta_s);
        break;
      case "eval":
        if (this.evals.some((e) => e[0] === event.step)) break;
        this.evals.push([event.step, event.loss]);
        break;
      case "checkpoint":
        this.$("state").textContent = `checkpoint at step ${event.step}`;
        break;
      case "sample": {
        // images are files of the run directory ("samples/step000020_0.png"), served by the pack's route
        const box = this.$("samples");
        if (box.querySelector(`[data-step="${event.step}"]`)) break; // replayed already
        (event.images || []).forEach((path, i) => {
          const img = document.createElement("img");
          img.src = api.apiURL(`/ingraph/runs/${encodeURIComponent(runId)}/${path.split("/").map(encodeURIComponent).join("/")}`);
          img.dataset.step = String(event.step);
          img.title = `step ${event.step}: ${(event.prompts || [])[i] ?? ""}`;
          img.style.cssText = "height:64px;border-radius:3px;image-rendering:pixelated";
          box.prepend(img);
        });
        break;
      }
      case "finished":
        this.state = event.stopped ? "stopped" : "finished";
        this.$("state").textContent = `${this.state} at step ${event.steps}: ${event.adapter || ""}`;
        break;
      case "error":
        this.state = "failed";
        this.$("state").textContent = `error: ${event.message}`;
        break;
    }
    const stop = this.$("stop");
    stop.disabled = this.state !== "running";
    stop.style.opacity = stop.disabled ? "0.4" : "1";
    stop.style.cursor = stop.disabled ? "default" : "pointer";
    this.draw();
  }

  draw() {
    const canvas = this.$("chart");
    const dpr = window.devicePixelRatio || 1; // sharp lines and text on high-density screens
    const w = Math.max(100, canvas.clientWidth), h = Math.max(60, canvas.clientHeight);
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    canvas.dataset.points = String(this.losses.length);
    canvas.dataset.evals = String(this.evals.length);
    const values = this.losses.concat(this.evals.map((e) => e[1]));
    if (!values.length) return;
    let lo = Math.min(...values), hi = Math.max(...values);
    if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
    const maxStep = Math.max(this.total || 1, ...this.steps, ...this.evals.map((e) => e[0]));
    const x = (s) => 4 + ((w - 8) * s) / maxStep, y = (v) => 4 + (h - 8) * (1 - (v - lo) / (hi - lo));
    const line = (vals, color, width) => {
      ctx.strokeStyle = color; ctx.lineWidth = width; ctx.beginPath();
      vals.forEach((v, i) => (i ? ctx.lineTo(x(this.steps[i]), y(v)) : ctx.moveTo(x(this.steps[i]), y(v))));
      ctx.stroke();
    };
    line(this.losses, "#4a6fa8", 1);
    line(smooth(this.losses), "#7cc8ff", 2);
    ctx.fillStyle = "#ffaa3c";
    for (const [s, v] of this.evals) { ctx.beginPath(); ctx.arc(x(s), y(v), 3, 0, 2 * Math.PI); ctx.fill(); }
    ctx.fillStyle = "#999"; ctx.font = "10px sans-serif";
    ctx.fillText(hi.toPrecision(4), 6, 12); ctx.fillText(lo.toPrecision(4), 6, h - 6);
  }

  // after a page reload: rebuild the history of this node's newest run from the run record
  async restore() {
    this.buffer = []; // live events that arrive meanwhile are applied after the history
    let events = [], runId = null;
    try {
      const runs = (await (await api.fetchApi("/ingraph/runs")).json()).runs || [];
      const mine = runs.filter((r) => r.node === String(this.node.id));
      const run = mine.find((r) => r.state === "running") || mine[0];
      if (run) {
        runId = run.id;
        events = (await (await api.fetchApi(`/ingraph/runs/${encodeURIComponent(run.id)}/events?since=0`)).json()).events;
      }
    } catch (e) {
      console.warn("InGraph Trainer: could not restore the run history", e);
    }
    const live = this.buffer;
    this.buffer = null;
    if (runId && !live.some(([id, e]) => id !== runId && e.type === "started")) {
      for (const event of events) this.handle(runId, event);
    }
    for (const [id, event] of live) this.handle(id, event); // duplicates of the history are skipped
  }
}

app.registerExtension({
  name: "ingraph.trainer.panel",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== TRAIN_NODE) return;
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
