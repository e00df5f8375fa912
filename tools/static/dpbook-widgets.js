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
 */
(function () {
  "use strict";

  var TEXT = {
    en: {
      preset: "link", machine: "this machine (fitted: {n} processes)", alpha: "α (µs)",
      bandwidth: "1/β (GB/s)", devices: "devices N", size: "message size",
      time: "time", bus: "bus bandwidth", algorithm: "algorithm",
      crossover: "ring overtakes tree above {size}", noCrossover: "no crossover: {which} is faster at every size",
      xlabel: "message size (bytes)", ylabel: "seconds",
      play: "Play", pause: "Pause", back: "Step back", forward: "Step forward",
      reset: "Back to the start", speed: "speed",
      round: "round {k} of {n}", start: "before the first message",
      reduce: "reduce-scatter: each receiver adds the chunk to its own",
      gather: "all-gather: finished chunks are copied on",
      chunk: "chunk", rank: "rank", posted: "posted {t} ms after the start",
      done: "every rank holds the sum", keys: "keys: ← → step, space play/pause",
      zoomIn: "Zoom in", zoomOut: "Zoom out", fit: "Whole step",
      timelineKeys: "keys: + − zoom, ← → move; hover a block for its time",
      ms: "ms since the first recorded event of the step", span: "{lane}: {start} ms, lasts {length} ms"
    },
    zh: {
      preset: "链路", machine: "本机（{n}个进程时的拟合值）", alpha: "α（µs）",
      bandwidth: "1/β（GB/s）", devices: "设备数N", size: "消息大小",
      time: "时间", bus: "总线带宽", algorithm: "算法",
      crossover: "消息大于{size}时环形算法快于树形算法", noCrossover: "没有交点：无论消息多大，都是{which}更快",
      xlabel: "消息大小（字节）", ylabel: "时间（秒）",
      play: "播放", pause: "暂停", back: "后退一步", forward: "前进一步",
      reset: "回到开头", speed: "速度",
      round: "第{k}轮（共{n}轮）", start: "尚未发出任何消息",
      reduce: "归约散播：每个接收者都把收到的块加到自己对应的块上",
      gather: "全收集：把求和完毕的块沿环复制下去",
      chunk: "块", rank: "进程", posted: "在开始后{t} ms发出",
      done: "每个进程都得到了总和", keys: "按键：← →单步，空格播放/暂停",
      zoomIn: "放大", zoomOut: "缩小", fit: "显示完整的一步",
      timelineKeys: "按键：+ −缩放，← →移动；把鼠标停在色块上可以看到时间",
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

  // ------------------------------------------------------------------ the calculator
  function mountAlphaBeta(root, data, t) {
    var state = { alpha: data.alpha, beta: data.beta, N: data.processes, log2size: 24 };
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

    var svg = el("svg:svg", { viewBox: "0 0 640 320", role: "img", "class": "dpbook-chart" }, root);
    var readout = el("div", { "class": "dpbook-widget-readout", "aria-live": "polite" }, root);

    function sync() {
      alpha.value = +(state.alpha * 1e6).toPrecision(4);
      bandwidth.value = +(1 / state.beta / 1e9).toPrecision(4);
      devices.value = state.N;
      size.value = state.log2size;
    }

    preset.addEventListener("change", function () {
      if (preset.value === "machine") {
        state.alpha = data.alpha; state.beta = data.beta;
      } else {
        state.beta = data.links[preset.value];      // the link's β; α stays the reader's
      }
      sync(); draw();
    });
    alpha.addEventListener("input", function () {
      if (alpha.value !== "" && +alpha.value >= 0) { state.alpha = +alpha.value * 1e-6; draw(); }
    });
    bandwidth.addEventListener("input", function () {
      if (+bandwidth.value > 0) { state.beta = 1 / (+bandwidth.value * 1e9); draw(); }
    });
    devices.addEventListener("input", function () {
      var n = Math.round(+devices.value);
      if (n >= 1 && n <= 65536) { state.N = n; draw(); }
    });
    size.addEventListener("input", function () { state.log2size = +size.value; draw(); });

    function draw() {
      var W = 640, H = 320, left = 64, right = 16, top = 12, bottom = 44;
      var xmin = 10, xmax = 30;                               // log2 of the size in bytes
      var sizes = [];
      for (var k = xmin; k <= xmax; k += 0.25) { sizes.push(Math.pow(2, k)); }
      var times = {};
      var ymin = Infinity, ymax = 0;
      ALGORITHMS.forEach(function (a) {
        times[a] = sizes.map(function (n) { return predict(a, n, state.N, state.alpha, state.beta); });
        times[a].forEach(function (s) { if (s > 0) { ymin = Math.min(ymin, s); ymax = Math.max(ymax, s); } });
      });
      if (!(ymax > 0)) { ymin = 1e-6; ymax = 1; }
      var ylo = Math.floor(Math.log10(ymin)), yhi = Math.ceil(Math.log10(ymax));
      if (yhi === ylo) { yhi += 1; }
      var x = function (n) { return left + (Math.log2(n) - xmin) / (xmax - xmin) * (W - left - right); };
      var y = function (s) {
        var v = Math.log10(Math.max(s, Math.pow(10, ylo)));
        return H - bottom - (v - ylo) / (yhi - ylo) * (H - top - bottom);
      };
      while (svg.firstChild) { svg.removeChild(svg.firstChild); }
      var axes = el("svg:g", { "class": "dpbook-axes" }, svg);
      for (var e = ylo; e <= yhi; e += 1) {
        el("svg:line", { x1: left, x2: W - right, y1: y(Math.pow(10, e)), y2: y(Math.pow(10, e)),
                         "class": "dpbook-grid" }, axes);
        el("svg:text", { x: left - 6, y: y(Math.pow(10, e)) + 4, "text-anchor": "end" }, axes,
           "1e" + e);
      }
      for (var b = xmin; b <= xmax; b += 5) {
        el("svg:line", { x1: x(Math.pow(2, b)), x2: x(Math.pow(2, b)), y1: top, y2: H - bottom,
                         "class": "dpbook-grid" }, axes);
        el("svg:text", { x: x(Math.pow(2, b)), y: H - bottom + 16, "text-anchor": "middle" }, axes,
           formatBytes(Math.pow(2, b)));
      }
      el("svg:text", { x: (left + W - right) / 2, y: H - 6, "text-anchor": "middle" }, axes, t.xlabel);
      el("svg:text", { x: 14, y: (top + H - bottom) / 2, "text-anchor": "middle",
                       transform: "rotate(-90 14 " + (top + H - bottom) / 2 + ")" }, axes, t.ylabel);
      ALGORITHMS.forEach(function (a, i) {
        var points = sizes.map(function (n, j) { return x(n).toFixed(1) + "," + y(times[a][j]).toFixed(1); });
        el("svg:polyline", { points: points.join(" "), fill: "none", stroke: COLORS[a],
                             "stroke-width": 2, "data-algorithm": a }, svg);
        el("svg:text", { x: left + 8, y: top + 14 + 14 * i, style: "fill: " + COLORS[a] }, svg, a);
      });
      var cross = state.N > 1 ? crossover(state.N, state.alpha, state.beta) : null;
      if (cross !== null && cross >= Math.pow(2, xmin) && cross <= Math.pow(2, xmax)) {
        el("svg:line", { x1: x(cross), x2: x(cross), y1: top, y2: H - bottom,
                         "class": "dpbook-crossover" }, svg);
      }
      var chosen = Math.pow(2, state.log2size);
      el("svg:line", { x1: x(chosen), x2: x(chosen), y1: top, y2: H - bottom,
                       "class": "dpbook-chosen" }, svg);
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
        el("td", {}, row, a);
        el("td", { "data-seconds": s }, row, state.N > 1 ? formatSeconds(s) : "0");
        el("td", {}, row, state.N > 1 && s > 0
          ? (busBandwidth(chosen, s, state.N) / 1e9).toPrecision(3) + " GB/s" : "–");
      });
      var note = el("p", { "data-role": "crossover" }, readout);
      if (state.N <= 1) {
        note.textContent = "";
      } else if (cross !== null) {
        note.textContent = fill(t.crossover, { size: formatBytes(cross) });
      } else {
        var ringFaster = predict("ring", chosen, state.N, state.alpha, state.beta)
                         <= predict("tree", chosen, state.N, state.alpha, state.beta);
        note.textContent = fill(t.noCrossover, { which: ringFaster ? "ring" : "tree" });
      }
      root.dataset.alpha = state.alpha;
      root.dataset.beta = state.beta;
    }

    sync();
    draw();
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
        el("svg:text", { x: p[0], y: p[1] + 5, "text-anchor": "middle" }, svg, String(r));
      }
      var words = current === 0 ? t.start
        : fill(t.round, { k: current, n: last }) + " · "
          + (current <= (N - 1) ? t.reduce : t.gather)
          + (frame.messages.length ? " · " + fill(t.posted, {
              t: (Math.min.apply(null, frame.messages.map(function (m) { return m.time; })) * 1e3).toFixed(2) }) : "");
      if (current === last) { words += " · " + t.done; }
      status.textContent = words;

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
    var COLOR = { backward: "#1f77b4", allreduce: "#ff7f0e" };

    function draw() {
      while (svg.firstChild) { svg.removeChild(svg.firstChild); }
      var span = view.to - view.from;
      var x = function (ms) { return left + (ms - view.from) / span * (W - left - right); };
      var step = Math.pow(10, Math.floor(Math.log10(span / 8)));     // 1, 2 or 5 × 10^k:
      step *= span / step > 40 ? 5 : span / step > 16 ? 2 : 1;        // at most 8 ticks
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
          el("svg:text", { x: 12, y: y + 14 }, svg, lane);
          var group = el("svg:g", { "clip-path": "url(#" + clip.id + ")", "data-lane": name + "/" + lane }, svg);
          data[name][lane].forEach(function (s) {
            if (s[0] + s[1] < view.from || s[0] > view.to) { return; }
            var rect = el("svg:rect", { x: x(s[0]), y: y, height: rowH - 4, fill: COLOR[lane],
                                        width: Math.max(x(s[0] + s[1]) - x(s[0]), 0.8) }, group);
            el("svg:title", {}, rect, fill(t.span, { lane: lane, start: s[0].toFixed(3),
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
