"use strict";
// The chat page: a conversation through this server's own /v1/chat/completions (streamed), each reply's steps
// asked for with "x_timeline" and drawn beside it by timeline.js.
(function () {
  const $ = (id) => document.getElementById(id);
  const T = window.MirrorTimeline;
  const LAST = 16; // steps the live timeline shows
  const log = $("log"), form = $("composer"), input = $("input"), send = $("send"), stop = $("stop");
  const status = $("status"), svg = $("timeline");
  let model = null, messages = [], running = null, shown = [], conversation = 0;

  fetch("/v1/models").then((r) => r.json()).then((j) => {
    model = j.data[0].id;
    $("model").textContent = model;
    document.title = `${model} · mirror-mlx`;
  }).catch(() => { $("model").textContent = "(the server did not say its model)"; });
  T.legend($("legend"));
  T.draw(svg, [], LAST);

  function bubble(role, text) {
    const box = document.createElement("div");
    box.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "you" : model || "model";
    const body = document.createElement("div");
    body.className = "body";
    body.textContent = text;
    box.append(who, body);
    log.appendChild(box);
    log.scrollTop = log.scrollHeight;
    return body;
  }

  function picture(steps) {
    shown = steps;
    const n = T.showNumbers($("numbers"), steps);
    T.draw(svg, steps, LAST);
    $("why").textContent = n.why ? `why: ${n.why}` : "";
  }

  function say(text, error) {
    status.textContent = text;
    status.classList.toggle("error", !!error);
  }

  function busy(on) {
    send.disabled = on;
    stop.disabled = !on;
    log.dataset.state = on ? "streaming" : "idle";
  }

  // One reply, streamed: the text as it comes, its steps drawn; what the server says is wrong, in one line.
  async function ask(text) {
    messages.push({role: "user", content: text});
    bubble("user", text);
    const body = bubble("assistant", "");
    body.classList.add("marked");
    const reply = {content: "", steps: [], ids: []}, mine = conversation;
    const controller = new AbortController();
    running = controller;
    busy(true);
    say("");
    let drawn = false;
    const render = () => {
      drawn = false;
      if (mine !== conversation) return; // a new conversation began meanwhile
      T.mark(body, reply.content, reply.steps);
      picture(reply.steps);
      body.dataset.ids = reply.ids.join(",");
      log.scrollTop = log.scrollHeight;
    };
    const handle = (data) => {
      if (data === "[DONE]") return;
      const j = JSON.parse(data);
      if (j.error) throw new Error(j.error.message);
      const choice = (j.choices || [])[0];
      if (choice && choice.delta && choice.delta.content) reply.content += choice.delta.content;
      for (const s of j.x_mirror_steps || []) {
        reply.steps.push(s);
        for (const t of s.tokens) reply.ids.push(t[2]);
      }
      if (choice && choice.finish_reason) reply.finish = choice.finish_reason;
      if (!drawn) { drawn = true; requestAnimationFrame(render); }
    };
    try {
      const temperature = parseFloat($("temperature").value);
      const maxTokens = parseInt($("max-tokens").value, 10);
      const res = await fetch("/v1/chat/completions", {
        method: "POST", headers: {"Content-Type": "application/json"}, signal: controller.signal,
        body: JSON.stringify({model: model || "default_model", messages, stream: true, x_timeline: true,
                              temperature: isNaN(temperature) ? 0 : temperature,
                              max_tokens: isNaN(maxTokens) ? null : maxTokens}),
      });
      if (!res.ok) {
        const j = await res.json().catch(() => null);
        throw new Error(j && j.error ? j.error.message : `the server answered ${res.status}`);
      }
      const reader = res.body.getReader(), decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += decoder.decode(value, {stream: true});
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          for (const line of buf.slice(0, end).split("\n")) if (line.startsWith("data: ")) handle(line.slice(6));
          buf = buf.slice(end + 2);
        }
      }
      say(reply.finish === "length" ? "stopped at max tokens" : "");
    } catch (e) {
      if (mine === conversation) {
        say(e.name === "AbortError" ? "stopped" : e.message, e.name !== "AbortError");
        if (e.name !== "AbortError" && !reply.content) messages.pop(); // the turn did not happen: ask again
      }
    } finally {
      render();
      if (reply.content && mine === conversation) messages.push({role: "assistant", content: reply.content});
      body.dataset.done = "1";
      running = null;
      busy(false);
      input.focus();
    }
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if (!text || running) return;
    input.value = "";
    ask(text);
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    } else if (e.key === "Escape" && running) {
      running.abort();
    }
  });
  stop.addEventListener("click", () => { if (running) running.abort(); });
  $("new").addEventListener("click", () => {
    if (running) running.abort();
    conversation += 1;
    messages = [];
    log.textContent = "";
    say("");
    picture([]);
    input.focus();
  });
  window.addEventListener("resize", () => T.draw(svg, shown, LAST));
  busy(false);
})();
