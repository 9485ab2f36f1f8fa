// The status page: render each status the server pushes over /ws.
// Plain JavaScript, no library and nothing fetched but from this server.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en"));
  const bytes = (n) => {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  };
  const time = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");
  const text = (v) => (v === null || v === undefined ? "–" : String(v));

  function rows(table, pairs) {
    table.replaceChildren(...pairs.map(([k, v]) => {
      const tr = document.createElement("tr");
      const a = document.createElement("td"); a.className = "k"; a.textContent = k;
      const b = document.createElement("td"); b.textContent = v;
      tr.append(a, b);
      return tr;
    }));
  }

  function list(table, items, cells) {
    const body = table.tBodies[0];
    body.replaceChildren(...items.map((item) => {
      const tr = document.createElement("tr");
      for (const c of cells(item)) {
        const td = document.createElement("td"); td.textContent = c; tr.append(td);
      }
      return tr;
    }));
  }

  function chart(points) {
    const canvas = $("chart");
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
    canvas.width = w * ratio; canvas.height = h * ratio;
    const g = canvas.getContext("2d");
    g.scale(ratio, ratio);
    g.clearRect(0, 0, w, h);
    const pad = 28;
    const max = Math.max(1, ...points.map((p) => p[1]));
    g.strokeStyle = "#e2e5ea"; g.fillStyle = "#6b7380"; g.font = "11px system-ui";
    for (const f of [0, 0.5, 1]) {
      const y = h - 16 - f * (h - 24);
      g.beginPath(); g.moveTo(pad, y); g.lineTo(w, y); g.stroke();
      g.fillText(String(Math.round(max * f)), 2, y + 4);
    }
    if (points.length < 2) return;
    const t0 = points[0][0], t1 = points[points.length - 1][0];
    const x = (t) => pad + ((t - t0) / Math.max(1e-9, t1 - t0)) * (w - pad - 4);
    const y = (r) => h - 16 - (r / max) * (h - 24);
    g.beginPath();
    points.forEach((p, i) => (i ? g.lineTo(x(p[0]), y(p[1])) : g.moveTo(x(p[0]), y(p[1]))));
    g.strokeStyle = "#0b5cad"; g.lineWidth = 2; g.stroke();
    g.lineTo(x(t1), h - 16); g.lineTo(x(t0), h - 16); g.closePath();
    g.fillStyle = "rgba(11, 92, 173, 0.12)"; g.fill();
    g.fillStyle = "#6b7380";
    g.fillText(Math.round(t1 - t0) + " s", w - 40, h - 2);
  }

  function render(s) {
    const role = $("role");
    role.textContent = s.role; role.dataset.role = s.role;
    const ready = $("ready");
    ready.textContent = s.ready ? "ready" : "not ready";
    ready.className = "badge " + (s.ready ? "ready" : "notready");
    ready.title = s.ready_reason;
    $("mode").textContent = s.mode + " · " + s.version +
      (s.data_format == null ? "" : " (format " + s.data_format + ")");
    $("sequence").textContent = fmt(s.sequence);
    $("keys").textContent = fmt(s.keys);
    $("rate").textContent = s.rate.toFixed(1);
    $("subscribers").textContent = fmt(s.subscribers);
    $("store_bytes").textContent = bytes(s.store_bytes);
    $("pending").textContent = fmt(s.pending);
    document.title = "Clone · " + s.role + " · " + s.sequence;
    const p = s.peer_state || {};
    rows($("peer"), [
      ["peer", text(s.peer)],
      ["peer state", text(p.state)],
      ["peer alive", p.alive === undefined ? "–" : (p.alive ? "yes" : "no")],
      ["last contact", p.last_contact === null || p.last_contact === undefined ? "–" : p.last_contact.toFixed(2) + " s ago"],
      ["sync", s.sync_state + (s.in_step === null ? "" : (s.in_step ? " (in step)" : " (not in step)"))],
      ["readiness", s.ready_reason],
    ]);
    rows($("server"), [
      ["uptime", Math.round(s.uptime) + " s"],
      ["Binary Star", text(s.ha_state) + (s.epoch === null ? "" : ", epoch " + s.epoch)],
      ["term", text(s.term)],
      ["data", s.durable ? s.data_dir : "in memory"],
      ["CURVE", s.curve ? "on" : "off"],
      // The newest row of the failover table below (role_changes, newest first).
      ["last role change", time(s.role_changes && s.role_changes.length ? s.role_changes[0].time : s.last_failover)],
    ]);
    list($("recent"), s.recent, (c) => [fmt(c.sequence), c.key]);
    list($("failovers"), s.role_changes, (c) => [time(c.time), c.from, c.to]);
    rows($("limits"), Object.entries(s.limits).map(([k, v]) => [k, fmt(v)]));
    rows($("counters"), Object.entries(s.counters).map(([k, v]) => [k, fmt(v)]));
    chart(s.rate_history);
  }

  let delay = 500;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const base = location.pathname.replace(/[^/]*$/, "");
    const ws = new WebSocket(scheme + "//" + location.host + base + "ws");
    const link = $("link");
    ws.onopen = () => { delay = 500; link.textContent = "live"; link.className = "link up"; };
    ws.onmessage = (ev) => {
      try { render(JSON.parse(ev.data)); } catch (e) { console.error(e); }
    };
    ws.onclose = () => {
      link.textContent = "offline, reconnecting"; link.className = "link down";
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 5000);
    };
  }
  connect();
})();
