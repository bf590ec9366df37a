// An answer's tool steps (docs/tools.md): the orchestrator runs a tool the model called, between the
// answer's turns, and the run's stream says so (`step_started`, then `step_result`). Each step is a line
// above the answer, "calculator: running…" then "calculator: ok", that opens (a native <details>, so
// keyboards and screen readers get it for free) on the call's arguments and the tool's result. Both are
// untrusted text (the model wrote one, a tool the other): shown as text, never parsed as HTML.
const OUTCOMES = {
  ok: "done",
  error: "failed",
  timeout: "timed out",
  refused: "not allowed",
  interrupted: "interrupted (not run again)",
};

// The steps of one answer as its stream reports them: {callId, tool, arguments, outcome, text}, in order.
export function recordStep(steps, kind, data) {
  let step = steps.find((each) => each.callId === data.call_id);
  if (!step) {
    step = { callId: data.call_id, tool: data.tool, arguments: "", outcome: null, text: "" };
    steps.push(step);
  }
  if (kind === "step_started") step.arguments = data.arguments;
  else Object.assign(step, { outcome: data.outcome, text: data.text });
}

// The steps as a list element (null for none).
export function stepsView(steps) {
  if (!steps.length) return null;
  const list = document.createElement("ol");
  list.className = "steps";
  list.setAttribute("aria-label", "Tool steps");
  for (const step of steps) {
    const item = document.createElement("li");
    item.dataset.outcome = step.outcome || "running";
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    const state = step.outcome ? OUTCOMES[step.outcome] || step.outcome : "running…";
    summary.textContent = `Tool ${step.tool}: ${state}`;
    details.append(summary, labelled("Arguments", step.arguments));
    if (step.outcome) details.append(labelled("Result", step.text));
    item.append(details);
    list.append(item);
  }
  return list;
}

function labelled(label, text) {
  const figure = document.createElement("figure");
  const caption = document.createElement("figcaption");
  caption.textContent = label;
  const body = document.createElement("pre");
  body.textContent = text;
  figure.append(caption, body);
  return figure;
}
