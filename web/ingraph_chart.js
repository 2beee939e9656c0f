// InGraph Trainer: bounded series and the loss chart of the Train node's panel (no DOM, no ComfyUI imports,
// so node can run it in tests). A run of a million steps keeps at most `cap` buckets per series and draws
// at most two points per bucket; nothing spreads an array into function arguments (that overflows the stack).

export const SERIES_BUCKETS = 1000; // at most 2,000 drawn points per series

// A series of (step, value) points with steps rising, kept as at most `cap` buckets of equal step width that
// remember their lowest and highest point: spikes survive the downsampling. When the buckets exceed `cap`,
// the width doubles and neighbours merge, so memory stays bounded and each point costs O(1) amortised.
export class Series {
  constructor(cap = SERIES_BUCKETS) {
    this.cap = cap;
    this.clear();
  }

  clear() {
    this.width = 1;
    this.buckets = []; // {key, lo, loStep, hi, hiStep}
    this.count = 0; // points pushed (finite ones)
    this.lo = Infinity; this.hi = -Infinity; this.lastStep = 0;
  }

  push(step, value) {
    if (!Number.isFinite(step) || !Number.isFinite(value)) return; // a NaN loss is not drawn
    this.count++;
    if (value < this.lo) this.lo = value;
    if (value > this.hi) this.hi = value;
    if (step > this.lastStep) this.lastStep = step;
    const key = Math.floor(step / this.width);
    const last = this.buckets[this.buckets.length - 1];
    if (last && last.key === key) {
      if (value < last.lo) { last.lo = value; last.loStep = step; }
      if (value > last.hi) { last.hi = value; last.hiStep = step; }
      return;
    }
    this.buckets.push({ key, lo: value, loStep: step, hi: value, hiStep: step });
    while (this.buckets.length > this.cap) this.coarsen();
  }

  coarsen() {
    this.width *= 2;
    const merged = [];
    for (const b of this.buckets) {
      const key = Math.floor(b.key / 2);
      const m = merged[merged.length - 1];
      if (m && m.key === key) {
        if (b.lo < m.lo) { m.lo = b.lo; m.loStep = b.loStep; }
        if (b.hi > m.hi) { m.hi = b.hi; m.hiStep = b.hiStep; }
      } else {
        merged.push({ ...b, key });
      }
    }
    this.buckets = merged;
  }

  // the points to draw, in step order: each bucket's low and high point (one when they coincide)
  points() {
    const out = [];
    for (const b of this.buckets) {
      if (b.loStep === b.hiStep) out.push([b.loStep, b.lo]);
      else if (b.loStep < b.hiStep) out.push([b.loStep, b.lo], [b.hiStep, b.hi]);
      else out.push([b.hiStep, b.hi], [b.loStep, b.lo]);
    }
    return out;
  }
}

// Bias-corrected exponential moving average, one value at a time (the chart's smoothed line).
export class Smoother {
  constructor(beta = 0.9) { this.beta = beta; this.avg = 0; this.n = 0; }
  clear() { this.avg = 0; this.n = 0; }
  push(v) {
    if (!Number.isFinite(v)) return null;
    this.n++;
    this.avg = this.beta * this.avg + (1 - this.beta) * v;
    return this.avg / (1 - Math.pow(this.beta, this.n));
  }
}

// Draws the loss (raw and smoothed), the evaluations and, for a distillation, the fake score's loss (`fake`, a
// second series) on a 2D context of w x h CSS pixels; returns how many points it drew.
export function drawChart(ctx, w, h, { loss, smooth, evals, total, fake }) {
  ctx.clearRect(0, 0, w, h);
  let lo = Math.min(loss.lo, evals.lo, fake ? fake.lo : Infinity);
  let hi = Math.max(loss.hi, evals.hi, fake ? fake.hi : -Infinity);
  if (!(hi >= lo)) return 0; // nothing finite yet
  if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
  const maxStep = Math.max(total || 1, loss.lastStep, evals.lastStep, fake ? fake.lastStep : 0, 1);
  const x = (s) => 4 + ((w - 8) * s) / maxStep, y = (v) => 4 + (h - 8) * (1 - (v - lo) / (hi - lo));
  let drawn = 0;
  const line = (series, color, width) => {
    ctx.strokeStyle = color; ctx.lineWidth = width; ctx.beginPath();
    const points = series.points();
    points.forEach(([s, v], i) => (i ? ctx.lineTo(x(s), y(v)) : ctx.moveTo(x(s), y(v))));
    drawn += points.length;
    ctx.stroke();
  };
  line(loss, "#4a6fa8", 1);
  line(smooth, "#7cc8ff", 2);
  if (fake && fake.count) line(fake, "#d98cff", 1);
  ctx.fillStyle = "#ffaa3c";
  for (const [s, v] of evals.points()) { ctx.beginPath(); ctx.arc(x(s), y(v), 3, 0, 2 * Math.PI); ctx.fill(); drawn++; }
  ctx.fillStyle = "#999"; ctx.font = "10px sans-serif";
  ctx.fillText(hi.toPrecision(4), 6, 12); ctx.fillText(lo.toPrecision(4), 6, h - 6);
  return drawn;
}
