/* The book's interactive widgets, placed by the `dpbook-widget` directive
 * (tools/dpbook_site.py): an α–β calculator, a replay of a recorded ring allreduce, and
 * a zoomable timeline of profiled DDP steps.
 *
 * Plain JavaScript, no library, nothing fetched: each widget reads the JSON its page
 * embeds (data the page's notebook computed when the book was built) and draws SVG.
 * A classic script, not a module, so the site also works opened from disk. Labels follow
 * the page's edition (`data-lang`); without JavaScript the page shows a static table.
 *
 * `window.dpbookWidgets.model` holds the α–β formulas, the same as dpbook.costmodel's
 * (the browser test compares them with the Python values).
 *
 * The drawings take the width they get on the page as their own (a phone gets a narrower
 * drawing, not a smaller one), and colours that dark mode would hide are set in
 * dpbook-site.css for both themes.
 */
(function () {
  "use strict";

  var TEXT = {
    en: {
      preset: "link", machine: "this machine (fitted: {n} processes)", alpha: "α (µs)",
      bandwidth: "1/β (GB/s)", devices: "devices N", size: "message size",
      time: "time", bus: "bus bandwidth", algorithm: "algorithm",
      names: { naive: "naive", ring: "ring", tree: "tree" },
      crossover: "ring overtakes tree above {size}", noCrossover: "no crossover: {which} is faster at every size",
      oneDevice: "one device: nothing to send",
      legendCrossover: "ring overtakes tree", legendChosen: "chosen size",
      bothMachine: "α and 1/β: fitted on this machine", alphaMachine: "α: fitted on this machine",
      betaMachine: "1/β: fitted on this machine",
      alphaLink: "α: typical for this link (an order of magnitude)",
      alphaKeptMachine: "α: still this machine's (no typical value given for this link)",
      alphaKept: "α: unchanged (no typical value given for this link)",
      alphaReader: "α: your value", betaLink: "1/β: the data sheet's peak",
      betaReader: "1/β: your value",
      xlabel: "message size (bytes)", ylabel: "time per allreduce",
      play: "Play", pause: "Pause", back: "Step back", forward: "Step forward",
      reset: "Back to the start", speed: "speed",
      round: "round {k} of {n}", start: "before the first message",
      reduce: "reduce-scatter: each receiver adds the chunk to its own",
      gather: "all-gather: finished chunks are copied on",
      chunk: "chunk", rank: "rank", posted: "posted {t} ms after the start",
      done: "every rank holds the sum", keys: "keys: ← → step, space play/pause",
      changed: "changed in this round", final: "final: the sum over all ranks",
      zoomIn: "Zoom in", zoomOut: "Zoom out", fit: "Whole step",
      timelineKeys: "keys: + − zoom, ← → move; hover a block for its time",
      lanes: { backward: "backward", allreduce: "allreduce" },
      ms: "ms since the first recorded event of the step", span: "{lane}: {start} ms, lasts {length} ms"
    },
    zh: {
      preset: "链路", machine: "本机（{n}个进程时的拟合值）", alpha: "α（µs）",
      bandwidth: "1/β（GB/s）", devices: "设备数N", size: "消息大小",
      time: "时间", bus: "总线带宽", algorithm: "算法",
      names: { naive: "朴素全归约", ring: "环形全归约", tree: "树形全归约" },
      crossover: "消息大于{size}时环形全归约快于树形全归约", noCrossover: "没有交点：无论消息多大，都是{which}更快",
      oneDevice: "只有一个设备：没有需要发送的数据",
      legendCrossover: "环形全归约开始更快", legendChosen: "所选的消息大小",
      bothMachine: "α和1/β：本机的拟合值", alphaMachine: "α：本机的拟合值",
      betaMachine: "1/β：本机的拟合值",
      alphaLink: "α：这种链路的典型值（数量级）",
      alphaKeptMachine: "α：仍是本机的拟合值（没有给出这种链路的典型值）",
      alphaKept: "α：保持不变（没有给出这种链路的典型值）",
      alphaReader: "α：你设定的值", betaLink: "1/β：数据手册中的峰值",
      betaReader: "1/β：你设定的值",
      xlabel: "消息大小（字节）", ylabel: "每次全归约的时间",
      play: "播放", pause: "暂停", back: "后退一步", forward: "前进一步",
      reset: "回到开头", speed: "速度",
      round: "第{k}轮（共{n}轮）", start: "尚未发出任何消息",
      reduce: "归约散播：每个接收者都把收到的块加到自己对应的块上",
      gather: "全收集：把求和完毕的块沿环复制下去",
      chunk: "块", rank: "进程", posted: "在开始后{t} ms发出",
      done: "每个进程都得到了总和", keys: "按键：← →单步，空格播放/暂停",
      changed: "本轮有变化", final: "已是所有进程的总和",
      zoomIn: "放大", zoomOut: "缩小", fit: "显示完整的一步",
      timelineKeys: "按键：+ −缩放，← →移动；把鼠标停在色块上可以看到时间",
      lanes: { backward: "反向传播", allreduce: "全归约" },
      ms: "从这一步记录到的第一个事件算起的时间（ms）", span: "{lane}：从{start} ms开始，持续{length} ms"
    }
  };

  function fill(template, values) {
    return template.replace(/\{(\w+)\}/g, function (_, k) { return values[k]; });
  }

  // ------------------------------------------------------------------ the α–β model
  var ALGORITHMS = ["naive", "ring", "tree"];

  /* [L, B] of an algorithm on N devices: time = L α + B n β (dpbook.costmodel.coefficients,
   * separate links). */
  function coefficients(algorithm, N) {
    if (!(N >= 1)) { throw new Error("need at least one device, got " + N); }
    if (algorithm === "naive") { return [2 * (N - 1), 2 * (N - 1)]; }
    if (algorithm === "ring") { return [2 * (N - 1), 2 * (N - 1) / N]; }
    if (algorithm === "tree") {
      var depth = Math.ceil(Math.log2(N));
      return [2 * depth, 2 * depth];
    }
    throw new Error("unknown algorithm " + algorithm);
  }

  function predict(algorithm, nbytes, N, alpha, beta) {
    var c = coefficients(algorithm, N);
    return c[0] * alpha + c[1] * nbytes * beta;
  }

  /* Bytes per second each link carried (dpbook.costmodel.bus_bandwidth). */
  function busBandwidth(nbytes, seconds, N) {
    return nbytes / seconds * 2 * (N - 1) / N;
  }

  /* The message size at which the ring and the tree take equal time, or null. */
  function crossover(N, alpha, beta) {
    var r = coefficients("ring", N), t = coefficients("tree", N);
    if (r[0] <= t[0] || t[1] <= r[1] || beta <= 0) { return null; }
    return (r[0] - t[0]) * alpha / ((t[1] - r[1]) * beta);
  }

  function formatSeconds(s) {
    if (s < 1e-3) { return (s * 1e6).toPrecision(3) + " µs"; }
    if (s < 1) { return (s * 1e3).toPrecision(3) + " ms"; }
    return s.toPrecision(3) + " s";
  }

  function formatBytes(n) {
    var units = ["B", "KiB", "MiB", "GiB"], i = 0;      // powers of 1024, so say so
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (n >= 100 ? n.toFixed(0) : n.toPrecision(3).replace(/\.?0+$/, "")) + " " + units[i];
  }

  /* A power of ten of seconds as a reader says it: 1 ms, 10 ms, 100 ms, 1 s. */
  function formatDecade(e) {
    var units = [[0, "s"], [-3, "ms"], [-6, "µs"], [-9, "ns"]];
    for (var i = 0; i < units.length; i += 1) {
      if (e >= units[i][0] || i === units.length - 1) {
        return +Math.pow(10, e - units[i][0]).toPrecision(1) + " " + units[i][1];
      }
    }
  }

  // ------------------------------------------------------------------ small DOM helpers
  var SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, parent, text) {
    var node = tag.indexOf("svg:") === 0 ? document.createElementNS(SVG, tag.slice(4))
                                         : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) { node.textContent = text; }
    if (parent) { parent.appendChild(node); }
    return node;
  }

  function labelled(parent, text, input) {
    var label = el("label", {}, parent);
    el("span", {}, label, text + " ");
    label.appendChild(input);
    return input;
  }

  var COLORS = { naive: "#1f77b4", ring: "#ff7f0e", tree: "#2ca02c" };

  /* The width, in CSS pixels, an SVG drawing gets on the page, between `min` and `max`:
   * the drawings use it as their viewBox width, so that an 11-px label stays 11 px on a
   * phone instead of shrinking with a 640-px drawing (640 before the page has a layout). */
  function drawingWidth(svg, min, max) {
    var w = svg.getBoundingClientRect().width;
    return w > 0 ? Math.round(Math.max(min, Math.min(max, w))) : max;
  }

  /* Calls `callback` when `node`'s width changes (a phone turned, a window resized). */
  function onWidthChange(node, callback) {
    var last = node.getBoundingClientRect().width;
    function check() {
      var w = node.getBoundingClientRect().width;
      if (Math.abs(w - last) >= 1) { last = w; callback(); }
    }
    if (window.ResizeObserver) { new ResizeObserver(check).observe(node); }
    else { window.addEventListener("resize", check); }
  }

  /* A legend in the corner of a chart: [{label, line attributes}], on a backdrop that
   * keeps it legible where a line runs under it. */
  function legend(svg, x, y, entries) {
    var group = el("svg:g", { "class": "dpbook-legend" }, svg);
    var backdrop = el("svg:rect", { x: x - 4, y: y - 4, rx: 3, "class": "dpbook-legend-backdrop" }, group);
    var widest = 0;
    entries.forEach(function (entry, i) {
      var ly = y + 7 + 15 * i;
      var attrs = { x1: x, x2: x + 20, y1: ly, y2: ly, "stroke-width": 2 };
      Object.keys(entry.line).forEach(function (k) { attrs[k] = entry.line[k]; });
      el("svg:line", attrs, group);
      var text = el("svg:text", { x: x + 26, y: ly + 4 }, group, entry.label);
      var w = 0;
      try { w = text.getComputedTextLength(); } catch (e) { w = 0; }
      widest = Math.max(widest, w || entry.label.length * 7);
    });
    backdrop.setAttribute("width", 26 + widest + 8);
    backdrop.setAttribute("height", 15 * entries.length + 8);
    return group;
  }

  // ------------------------------------------------------------------ the calculator
  /* data: {alpha, beta, processes: the fit of this machine; links: {name: β};
   * latencies (optional): {name: α}, a typical latency of each link}. A link preset sets
   * β, and α too where `latencies` names the link; otherwise α stays as it was. */
  function mountAlphaBeta(root, data, t) {
    var latencies = data.latencies || {};
    var state = { alpha: data.alpha, beta: data.beta, N: data.processes, log2size: 24,
                  alphaFrom: "machine", betaFrom: "machine" };
    var controls = el("div", { "class": "dpbook-widget-controls" }, root);
    var preset = labelled(controls, t.preset, el("select", { "data-role": "preset" }));
    el("option", { value: "machine" }, preset, fill(t.machine, { n: data.processes }));
    Object.keys(data.links).forEach(function (name) {
      el("option", { value: name }, preset, name);
    });
    var alpha = labelled(controls, t.alpha, el("input", {
      type: "number", min: "0", step: "any", "data-role": "alpha" }));
    var bandwidth = labelled(controls, t.bandwidth, el("input", {
      type: "number", min: "0.001", step: "any", "data-role": "bandwidth" }));
    var devices = labelled(controls, t.devices, el("input", {
      type: "number", min: "1", max: "65536", step: "1", "data-role": "devices" }));
    var size = labelled(controls, t.size, el("input", {
      type: "range", min: "10", max: "30", step: "1", "data-role": "size" }));
    var sizeText = el("output", {}, size.parentNode);
    var source = el("p", { "class": "dpbook-widget-note", "data-role": "source" }, root);

    var svg = el("svg:svg", { viewBox: "0 0 640 320", role: "img", "class": "dpbook-chart" }, root);
    var readout = el("div", { "class": "dpbook-widget-readout", "aria-live": "polite" }, root);

    function sync() {
      alpha.value = +(state.alpha * 1e6).toPrecision(4);
      bandwidth.value = +(1 / state.beta / 1e9).toPrecision(4);
      devices.value = state.N;
      size.value = state.log2size;
    }

    function describeSource() {
      var both = state.alphaFrom === "machine" && state.betaFrom === "machine";
      source.textContent = both ? t.bothMachine
        : t[{ machine: "alphaMachine", link: "alphaLink", keptMachine: "alphaKeptMachine",
              kept: "alphaKept", reader: "alphaReader" }[state.alphaFrom]]
          + " · " + t[{ machine: "betaMachine", link: "betaLink", reader: "betaReader" }[state.betaFrom]];
      root.dataset.alphaFrom = state.alphaFrom;
    }

    preset.addEventListener("change", function () {
      if (preset.value === "machine") {
        state.alpha = data.alpha; state.beta = data.beta;
        state.alphaFrom = state.betaFrom = "machine";
      } else {
        state.beta = data.links[preset.value]; state.betaFrom = "link";
        if (latencies[preset.value] > 0) {
          state.alpha = latencies[preset.value]; state.alphaFrom = "link";
        } else if (state.alphaFrom === "machine") {
          state.alphaFrom = "keptMachine";     // no typical α for it: α stays as it was
        } else if (state.alphaFrom === "link") {
          state.alphaFrom = "kept";
        }
      }
      sync(); draw();
    });
    alpha.addEventListener("input", function () {
      if (alpha.value !== "" && +alpha.value >= 0) {
        state.alpha = +alpha.value * 1e-6; state.alphaFrom = "reader"; draw();
      }
    });
    bandwidth.addEventListener("input", function () {
      if (+bandwidth.value > 0) {
        state.beta = 1 / (+bandwidth.value * 1e9); state.betaFrom = "reader"; draw();
      }
    });
    devices.addEventListener("input", function () {
      var n = Math.round(+devices.value);
      if (n >= 1 && n <= 65536) { state.N = n; draw(); }
    });
    size.addEventListener("input", function () { state.log2size = +size.value; draw(); });

    function draw() {
      var W = drawingWidth(svg, 300, 640), H = W >= 560 ? 320 : 300;
      var left = W >= 560 ? 64 : 52, right = 16, top = 12, bottom = 44;
      svg.setAttribute("viewBox", "0 0 " + W + " " + H);
      var xmin = 10, xmax = 30;                               // log2 of the size in bytes
      var sizes = [];
      for (var k = xmin; k <= xmax; k += 0.25) { sizes.push(Math.pow(2, k)); }
      var times = {};
      var ymin = Infinity, ymax = 0;
      ALGORITHMS.forEach(function (a) {
        times[a] = sizes.map(function (n) { return predict(a, n, state.N, state.alpha, state.beta); });
        times[a].forEach(function (s) { if (s > 0) { ymin = Math.min(ymin, s); ymax = Math.max(ymax, s); } });
      });
      if (!(ymax > 0)) { ymin = 1e-4; ymax = 1e-1; }
      var ylo = Math.floor(Math.log10(ymin)), yhi = Math.ceil(Math.log10(ymax));
      if (yhi === ylo) { yhi += 1; }
      var x = function (n) { return left + (Math.log2(n) - xmin) / (xmax - xmin) * (W - left - right); };
      var y = function (s) {
        var v = Math.log10(Math.max(s, Math.pow(10, ylo)));
        return H - bottom - (v - ylo) / (yhi - ylo) * (H - top - bottom);
      };
      while (svg.firstChild) { svg.removeChild(svg.firstChild); }
      var axes = el("svg:g", { "class": "dpbook-axes" }, svg);
      var every = Math.ceil((yhi - ylo) / 8);                 // at most 9 labelled decades
      for (var e = ylo; e <= yhi; e += 1) {
        el("svg:line", { x1: left, x2: W - right, y1: y(Math.pow(10, e)), y2: y(Math.pow(10, e)),
                         "class": "dpbook-grid" }, axes);
        if ((e - ylo) % every === 0) {
          el("svg:text", { x: left - 6, y: y(Math.pow(10, e)) + 4, "text-anchor": "end",
                           "class": "dpbook-ytick" }, axes,
             formatDecade(e));
        }
      }
      for (var b = xmin; b <= xmax; b += 5) {
        el("svg:line", { x1: x(Math.pow(2, b)), x2: x(Math.pow(2, b)), y1: top, y2: H - bottom,
                         "class": "dpbook-grid" }, axes);
        el("svg:text", { x: x(Math.pow(2, b)), y: H - bottom + 16,
                         "text-anchor": b === xmin ? "start" : b === xmax ? "end" : "middle" }, axes,
           formatBytes(Math.pow(2, b)));
      }
      el("svg:text", { x: (left + W - right) / 2, y: H - 6, "text-anchor": "middle" }, axes, t.xlabel);
      el("svg:text", { x: 12, y: (top + H - bottom) / 2, "text-anchor": "middle",
                       transform: "rotate(-90 12 " + (top + H - bottom) / 2 + ")" }, axes, t.ylabel);
      var one = state.N <= 1;
      if (one) {                                   // nothing travels: no curves to draw
        el("svg:text", { x: (left + W - right) / 2, y: (top + H - bottom) / 2,
                         "text-anchor": "middle", "class": "dpbook-chart-message" }, svg, t.oneDevice);
      } else {
        ALGORITHMS.forEach(function (a) {
          var points = sizes.map(function (n, j) { return x(n).toFixed(1) + "," + y(times[a][j]).toFixed(1); });
          el("svg:polyline", { points: points.join(" "), fill: "none", stroke: COLORS[a],
                               "stroke-width": 2, "data-algorithm": a }, svg);
        });
      }
      var cross = one ? null : crossover(state.N, state.alpha, state.beta);
      var crossShown = cross !== null && cross >= Math.pow(2, xmin) && cross <= Math.pow(2, xmax);
      if (crossShown) {
        el("svg:line", { x1: x(cross), x2: x(cross), y1: top, y2: H - bottom,
                         "class": "dpbook-crossover" }, svg);
      }
      var chosen = Math.pow(2, state.log2size);
      el("svg:line", { x1: x(chosen), x2: x(chosen), y1: top, y2: H - bottom,
                       "class": "dpbook-chosen" }, svg);
      var entries = one ? [] : ALGORITHMS.map(function (a) {
        return { label: t.names[a], line: { stroke: COLORS[a] } };
      });
      if (crossShown) { entries.push({ label: t.legendCrossover, line: { "class": "dpbook-crossover" } }); }
      entries.push({ label: t.legendChosen, line: { "class": "dpbook-chosen" } });
      legend(svg, left + 10, top + 8, entries);
      sizeText.textContent = formatBytes(chosen);
      svg.setAttribute("aria-label", t.xlabel + " / " + t.ylabel);

      while (readout.firstChild) { readout.removeChild(readout.firstChild); }
      var table = el("table", {}, readout);
      var head = el("tr", {}, el("thead", {}, table));
      [t.algorithm, t.time, t.bus].forEach(function (h) { el("th", {}, head, h); });
      var body = el("tbody", {}, table);
      ALGORITHMS.forEach(function (a) {
        var s = predict(a, chosen, state.N, state.alpha, state.beta);
        var row = el("tr", { "data-algorithm": a }, body);
        el("td", {}, row, t.names[a]);
        el("td", { "data-seconds": s }, row, one ? "0" : formatSeconds(s));
        el("td", {}, row, !one && s > 0
          ? (busBandwidth(chosen, s, state.N) / 1e9).toPrecision(3) + " GB/s" : "–");
      });
      var note = el("p", { "data-role": "crossover" }, readout);
      if (one) {
        note.textContent = t.oneDevice;
      } else if (cross !== null) {
        note.textContent = fill(t.crossover, { size: formatBytes(cross) });
      } else {
        var ringFaster = predict("ring", chosen, state.N, state.alpha, state.beta)
                         <= predict("tree", chosen, state.N, state.alpha, state.beta);
        note.textContent = fill(t.noCrossover, { which: t.names[ringFaster ? "ring" : "tree"] });
      }
      describeSource();
      root.dataset.alpha = state.alpha;
      root.dataset.beta = state.beta;
    }

    sync();
    draw();
    onWidthChange(root, draw);
  }

  // ------------------------------------------------------------------ the ring replay
  function isSend(e) { return e.kind === "send" || e.kind === "isend"; }

  /* Frames of a recorded run: frame 0 holds the initial tensors; frame k the messages of
   * round k (each rank's k-th send) and every rank's tensor once that round is done (its
   * tensor at its next send, or its final one). Right for the plain ring the page records;
   * a ring that sends twice per step (pipelined, bidirectional) would need its sends
   * grouped by time instead. */
  function framesOf(trace) {
    var sends = trace.ranks.map(function (r) { return r.events.filter(isSend); });
    var rounds = Math.max.apply(null, sends.map(function (s) { return s.length; }));
    var frames = [{ messages: [], states: trace.ranks.map(function (r) { return r.initial; }) }];
    for (var k = 0; k < rounds; k += 1) {
      frames.push({
        messages: sends.map(function (s, rank) {
          return s[k] ? { from: rank, to: s[k].peer, offset: s[k].offset, count: s[k].count,
                          values: s[k].values, time: s[k].time } : null;
        }).filter(Boolean),
        states: trace.ranks.map(function (r, rank) {
          return sends[rank][k + 1] ? sends[rank][k + 1].state : r.final;
        })
      });
    }
    return frames;
  }

  function chunkOf(trace, offset, count) {
    for (var c = 0; c < trace.chunks.length; c += 1) {
      if (trace.chunks[c][0] === offset && trace.chunks[c][1] === count) { return c; }
    }
    return null;
  }

  function mountRingReplay(root, trace, t) {
    var frames = framesOf(trace), N = trace.processes, current = 0, timer = null, speed = 1;
    root.setAttribute("tabindex", "0");
    var controls = el("div", { "class": "dpbook-widget-controls" }, root);
    var reset = el("button", { type: "button", "data-role": "reset", title: t.reset }, controls, "|◀");
    var back = el("button", { type: "button", "data-role": "back", title: t.back }, controls, "◀");
    var play = el("button", { type: "button", "data-role": "play", title: t.play }, controls, "▶");
    var forward = el("button", { type: "button", "data-role": "forward", title: t.forward }, controls, "▶|");
    var speedSelect = labelled(controls, t.speed, el("select", { "data-role": "speed" }));
    [0.5, 1, 2, 4].forEach(function (s) {
      var o = el("option", { value: s }, speedSelect, s + "×");
      if (s === 1) { o.selected = true; }
    });
    el("span", { "class": "dpbook-widget-keys" }, controls, t.keys);
    [reset, back, play, forward].forEach(function (b) { b.setAttribute("aria-label", b.title); });
    var status = el("p", { "class": "dpbook-widget-status", "aria-live": "polite" }, root);
    var stage = el("div", { "class": "dpbook-widget-stage" }, root);
    var svg = el("svg:svg", { viewBox: "0 0 300 300", role: "img", "class": "dpbook-ring" }, stage);
    var table = el("table", { "class": "dpbook-widget-table", "data-role": "states" }, stage);
    var key = el("p", { "class": "dpbook-widget-legend" }, root);   // what the colours mean
    [["dpbook-changed", "3, 5", t.changed], ["dpbook-final", "10, 14", t.final]].forEach(function (k) {
      var item = el("span", { "class": "dpbook-legend-item" }, key);
      el("span", { "class": "dpbook-legend-cell " + k[0] }, item, k[1]);
      el("span", {}, item, " " + k[2]);
    });

    var cx = 150, cy = 150, radius = 105;
    function position(rank) {
      var angle = -Math.PI / 2 + 2 * Math.PI * rank / N;
      return [cx + radius * Math.cos(angle), cy + radius * Math.sin(angle)];
    }
    var defs = el("svg:defs", {}, svg);
    var marker = el("svg:marker", { id: "dpbook-arrow-" + Math.random().toString(36).slice(2),
                                    viewBox: "0 0 10 10", refX: "9", refY: "5",
                                    markerWidth: "7", markerHeight: "7", orient: "auto" }, defs);
    el("svg:path", { d: "M0,0 L10,5 L0,10 z", fill: "#ff7f0e" }, marker);

    function render() {
      var frame = frames[current], last = frames.length - 1;
      root.dataset.frame = current;
      root.dataset.frames = last;
      Array.prototype.slice.call(svg.childNodes).forEach(function (n) {
        if (n !== defs) { svg.removeChild(n); }
      });
      frame.messages.forEach(function (m) {
        var a = position(m.from), b = position(m.to);
        var dx = b[0] - a[0], dy = b[1] - a[1], d = Math.sqrt(dx * dx + dy * dy) || 1;
        var shrink = 30 / d;
        el("svg:line", { x1: a[0] + dx * shrink, y1: a[1] + dy * shrink,
                         x2: b[0] - dx * shrink, y2: b[1] - dy * shrink, stroke: "#ff7f0e",
                         "stroke-width": 2, "marker-end": "url(#" + marker.id + ")" }, svg);
        var c = chunkOf(trace, m.offset, m.count);
        el("svg:text", { x: (a[0] + b[0]) / 2 + (dy / d) * 16, y: (a[1] + b[1]) / 2 - (dx / d) * 16 + 4,
                         "text-anchor": "middle", "class": "dpbook-ring-label" }, svg,
           (c === null ? "" : t.chunk + " " + c + ": ") + (m.values || []).join(","));
      });
      for (var r = 0; r < N; r += 1) {
        var p = position(r);
        el("svg:circle", { cx: p[0], cy: p[1], r: 24, "class": "dpbook-ring-node" }, svg);
        el("svg:text", { x: p[0], y: p[1] + 5, "text-anchor": "middle", "class": "dpbook-ring-rank" },
           svg, String(r));
      }
      status.textContent = statusText(current);

      while (table.firstChild) { table.removeChild(table.firstChild); }
      var head = el("tr", {}, el("thead", {}, table));
      el("th", {}, head, t.rank);
      trace.chunks.forEach(function (_, c) { el("th", {}, head, t.chunk + " " + c); });
      var body = el("tbody", {}, table);
      var previous = frames[Math.max(current - 1, 0)].states;
      frame.states.forEach(function (values, rank) {
        var row = el("tr", { "data-rank": rank }, body);
        el("th", {}, row, String(rank));
        trace.chunks.forEach(function (chunk, c) {
          var part = values.slice(chunk[0], chunk[0] + chunk[1]);
          var before = previous[rank].slice(chunk[0], chunk[0] + chunk[1]);
          var final = trace.ranks[rank].final.slice(chunk[0], chunk[0] + chunk[1]);
          var cls = (part.join() !== before.join() ? "dpbook-changed " : "")
                  + (part.join() === final.join() ? "dpbook-final" : "");
          el("td", { "class": cls, "data-values": JSON.stringify(part) }, row, part.join(", "));
        });
      });
      back.disabled = current === 0;
      forward.disabled = current === last;
    }

    function go(k) { current = Math.max(0, Math.min(frames.length - 1, k)); render(); }

    function statusText(k) {
      var frame = frames[k], last = frames.length - 1;
      var words = k === 0 ? t.start
        : fill(t.round, { k: k, n: last }) + " · "
          + (k <= (N - 1) ? t.reduce : t.gather)
          + (frame.messages.length ? " · " + fill(t.posted, {
              t: (Math.min.apply(null, frame.messages.map(function (m) { return m.time; })) * 1e3).toFixed(2) }) : "");
      if (k === last) { words += " · " + t.done; }
      return words;
    }
    /* The status line keeps the height of its longest text, so that nothing below it
     * jumps during playback; measured again when the width changes. */
    function fitStatus() {
      status.style.minHeight = "";
      var tallest = 0;
      for (var k = 0; k < frames.length; k += 1) {
        status.textContent = statusText(k);
        tallest = Math.max(tallest, status.getBoundingClientRect().height);
      }
      status.textContent = statusText(current);
      if (tallest > 0) { status.style.minHeight = Math.ceil(tallest) + "px"; }
    }
    function stop() {
      if (timer !== null) { clearInterval(timer); timer = null; }
      play.textContent = "▶"; play.title = t.play; play.setAttribute("aria-label", t.play);
    }
    function start() {
      if (current === frames.length - 1) { go(0); }
      play.textContent = "⏸"; play.title = t.pause; play.setAttribute("aria-label", t.pause);
      timer = setInterval(function () {
        if (current >= frames.length - 1) { stop(); } else { go(current + 1); }
      }, 900 / speed);
    }
    play.addEventListener("click", function () { if (timer === null) { start(); } else { stop(); } });
    forward.addEventListener("click", function () { stop(); go(current + 1); });
    back.addEventListener("click", function () { stop(); go(current - 1); });
    reset.addEventListener("click", function () { stop(); go(0); });
    speedSelect.addEventListener("change", function () {
      speed = +speedSelect.value;
      if (timer !== null) { stop(); start(); }
    });
    root.addEventListener("keydown", function (event) {
      if (event.target.tagName === "SELECT") { return; }
      if (event.key === "ArrowRight") { stop(); go(current + 1); event.preventDefault(); }
      else if (event.key === "ArrowLeft") { stop(); go(current - 1); event.preventDefault(); }
      else if (event.key === " " && event.target === root) {
        if (timer === null) { start(); } else { stop(); }
        event.preventDefault();
      }
    });
    render();
    fitStatus();
    onWidthChange(root, fitStatus);
  }

  // ------------------------------------------------------------------ the DDP timeline
  /* data: {variant: {backward: [[start, length], …], allreduce: […]}} in ms. */
  function mountTimeline(root, data, t) {
    var names = Object.keys(data), LANES = ["backward", "allreduce"];
    var end = 0;
    names.forEach(function (n) {
      LANES.forEach(function (lane) {
        data[n][lane].forEach(function (s) { end = Math.max(end, s[0] + s[1]); });
      });
    });
    var view = { from: 0, to: end || 1 };
    root.setAttribute("tabindex", "0");
    var controls = el("div", { "class": "dpbook-widget-controls" }, root);
    var zoomIn = el("button", { type: "button", "data-role": "zoom-in", title: t.zoomIn }, controls, "+");
    var zoomOut = el("button", { type: "button", "data-role": "zoom-out", title: t.zoomOut }, controls, "−");
    var fit = el("button", { type: "button", "data-role": "fit", title: t.fit }, controls, "↔");
    [zoomIn, zoomOut, fit].forEach(function (b) { b.setAttribute("aria-label", b.title); });
    el("span", { "class": "dpbook-widget-keys" }, controls, t.timelineKeys);
    var W = 640, left = 110, right = 12, rowH = 22, top = 8;
    var H = top + names.length * (2 * rowH + 14) + 34;
    var svg = el("svg:svg", { viewBox: "0 0 " + W + " " + H, role: "img", "class": "dpbook-timeline" }, root);
    var lanes = t.lanes || {};
    var COLOR = { backward: "#1f77b4", allreduce: "#ff7f0e" };

    function draw() {
      W = drawingWidth(svg, 300, 640);            // 1:1 on the page: labels stay legible
      left = W >= 560 ? 110 : 84;
      svg.setAttribute("viewBox", "0 0 " + W + " " + H);
      while (svg.firstChild) { svg.removeChild(svg.firstChild); }
      var span = view.to - view.from, ticks = W >= 560 ? 8 : 3;
      var x = function (ms) { return left + (ms - view.from) / span * (W - left - right); };
      var step = Math.pow(10, Math.floor(Math.log10(span / ticks)));  // 1, 2 or 5 × 10^k:
      step *= span / step > 5 * ticks ? 5 : span / step > 2 * ticks ? 2 : 1;   // ≤ `ticks`
      for (var tick = Math.ceil(view.from / step) * step; tick <= view.to; tick += step) {
        el("svg:line", { x1: x(tick), x2: x(tick), y1: top, y2: H - 30, "class": "dpbook-grid" }, svg);
        el("svg:text", { x: x(tick), y: H - 16, "text-anchor": "middle" }, svg,
           +tick.toPrecision(6) + "");
      }
      el("svg:text", { x: (left + W - right) / 2, y: H - 2, "text-anchor": "middle" }, svg, t.ms);
      var clip = el("svg:clipPath", { id: "dpbook-clip-" + Math.random().toString(36).slice(2) }, svg);
      el("svg:rect", { x: left, y: 0, width: W - left - right, height: H }, clip);
      names.forEach(function (name, i) {
        var y0 = top + i * (2 * rowH + 14);
        el("svg:text", { x: 4, y: y0 + 12, "font-weight": "bold" }, svg, name);
        LANES.forEach(function (lane, j) {
          var y = y0 + 14 + j * rowH;
          el("svg:text", { x: 12, y: y + 14 }, svg, lanes[lane] || lane);
          var group = el("svg:g", { "clip-path": "url(#" + clip.id + ")", "data-lane": name + "/" + lane }, svg);
          data[name][lane].forEach(function (s) {
            if (s[0] + s[1] < view.from || s[0] > view.to) { return; }
            var rect = el("svg:rect", { x: x(s[0]), y: y, height: rowH - 4, fill: COLOR[lane],
                                        width: Math.max(x(s[0] + s[1]) - x(s[0]), 0.8) }, group);
            el("svg:title", {}, rect, fill(t.span, { lane: lanes[lane] || lane, start: s[0].toFixed(3),
                                                     length: s[1].toFixed(3) }));
          });
        });
      });
      root.dataset.from = view.from;
      root.dataset.to = view.to;
    }

    function zoom(factor, centre) {
      var c = centre === undefined ? (view.from + view.to) / 2 : centre;
      var span = Math.min(end || 1, Math.max((view.to - view.from) * factor, (end || 1) / 1e4));
      view.from = Math.max(0, c - span / 2);
      view.to = Math.min(end || 1, view.from + span);
      view.from = Math.max(0, view.to - span);
      draw();
    }
    function pan(fraction) {
      var span = view.to - view.from, shift = span * fraction;
      view.from = Math.max(0, Math.min((end || 1) - span, view.from + shift));
      view.to = view.from + span;
      draw();
    }
    zoomIn.addEventListener("click", function () { zoom(0.5); });
    zoomOut.addEventListener("click", function () { zoom(2); });
    fit.addEventListener("click", function () { view.from = 0; view.to = end || 1; draw(); });
    root.addEventListener("keydown", function (event) {
      if (event.key === "+" || event.key === "=") { zoom(0.5); }
      else if (event.key === "-" || event.key === "_") { zoom(2); }
      else if (event.key === "ArrowRight") { pan(0.25); }
      else if (event.key === "ArrowLeft") { pan(-0.25); }
      else { return; }
      event.preventDefault();
    });
    svg.addEventListener("wheel", function (event) {
      var box = svg.getBoundingClientRect();
      var ms = view.from + ((event.clientX - box.left) / box.width * W - left)
               / (W - left - right) * (view.to - view.from);
      zoom(event.deltaY < 0 ? 0.8 : 1.25, Math.max(0, Math.min(end, ms)));
      event.preventDefault();
    }, { passive: false });
    draw();
    onWidthChange(root, draw);
  }

  var MOUNT = { "alpha-beta": mountAlphaBeta, "ring-replay": mountRingReplay,
                "timeline": mountTimeline };

  function mountAll() {
    var nodes = document.querySelectorAll(".dpbook-widget");
    Array.prototype.forEach.call(nodes, function (root) {
      if (root.dataset.mounted) { return; }
      var mount = MOUNT[root.dataset.widget];
      var script = root.querySelector('script[type="application/json"]');
      if (!mount || !script) { return; }
      var data = JSON.parse(script.textContent);
      var live = el("div", { "class": "dpbook-widget-live" });
      root.appendChild(live);
      mount(live, data, TEXT[root.dataset.lang] || TEXT.en);
      root.classList.add("dpbook-widget-mounted");      // hides the static fallback
      root.dataset.mounted = "1";
    });
  }

  window.dpbookWidgets = {
    model: { coefficients: coefficients, predict: predict, busBandwidth: busBandwidth,
             crossover: crossover },
    framesOf: framesOf,
    mountAll: mountAll
  };
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", mountAll);
  } else {
    mountAll();
  }
})();
