// A windowed list: of a long list of items, only those near the viewport are elements of the page.
// Two spacers stand for the rest, each as tall as the items it replaces: an item's height is measured
// whenever it is shown and remembered by its key (an average of those measured stands in for one never
// shown). The page's node count is bounded by what fits near the viewport, whatever the list's length.
//
// The scroll position is the reader's: when items are added above, or measured heights replace
// estimates, the item at the top of the view stays where it was (an anchor, restored after each
// update). A list scrolled to its end (`atBottom`) stays at its end as items grow or are added.
//
// An item's element is made in two steps: `render` (cheap: in the frame the item comes into view) and
// `refine` (the costly part, e.g. Markdown), done in the frames after within a budget per frame, those in
// view first, so a fast scroll through items never shown before costs no frame more than the budget.
// A frame forces one layout: spacers are sized before the window's elements are measured, and the
// anchor's place comes from that measure.
const OVERSCAN_PX = 900;    // rendered beyond each edge of the viewport
const BOTTOM_SLACK_PX = 48; // this close to the end counts as at the end
const DEFAULT_HEIGHT_PX = 120;
const RENDER_BUDGET_MS = 8; // elements made and refined per frame, beyond one in view, at most this long

export class WindowedList {
  // `render(item)` makes an item's element; items are objects with a unique `key`. `refine(item,
  // element)`, if given, finishes an element `render` made (true: it had work to do; false: nothing
  // was left). `head`, if given, is an element kept first in the list (above the top spacer).
  // `onScroll()` runs after each update made by scrolling. `focusFallback` takes focus when the
  // focused element leaves the window.
  constructor(scroller, { render, refine = null, head = null, onScroll = () => {}, focusFallback }) {
    this.scroller = scroller;
    this.render = render;
    this.refine = refine;
    this.rough = new Set();   // keys of the window's elements not refined yet
    this.head = head;
    this.onScroll = onScroll;
    this.focusFallback = focusFallback;
    this.items = [];
    this.heights = new Map(); // key -> measured height in px
    this.nodes = new Map();   // key -> its element, for the items in the window
    this.start = 0;           // the window: items [start, end)
    this.end = 0;
    this.atBottom = true;
    this.top = spacer();
    this.bottom = spacer();
    this.pending = false;
    this.scrolledTo = null;   // where an update last scrolled the list (its own scroll, not the reader's)
    scroller.addEventListener("scroll", () => {
      const own = this.scrolledTo !== null && Math.abs(scroller.scrollTop - this.scrolledTo) < 2;
      if (!own) this.atBottom = this.distanceToEnd() <= BOTTOM_SLACK_PX;
      this.scrolledTo = null;
      this.schedule();
    }, { passive: true });
    new ResizeObserver(() => this.schedule()).observe(scroller);
  }

  distanceToEnd() {
    const s = this.scroller;
    return s.scrollHeight - s.scrollTop - s.clientHeight;
  }

  // Replaces the items. `fresh`: the items' elements are made again (what they show depends on more
  // than their own message), else elements of kept keys are reused. `toEnd`: scroll to the end.
  // `headShown`: whether the head element shows (changed once the anchor is taken: it moves the items).
  setItems(items, { fresh = false, toEnd = false, headShown = true } = {}) {
    const anchor = this.anchor();
    if (this.head) this.head.hidden = !headShown;
    if (fresh) this.dropNodes();
    this.items = items;
    if (toEnd) this.atBottom = true;
    this.update(anchor);
  }

  // The element of an item now in the window (or undefined).
  node(key) {
    return this.nodes.get(key);
  }

  scrollToEnd() {
    this.atBottom = true;
    this.update(null);
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.update(this.anchor());
      this.onScroll();
    });
  }

  // The first item in view and how far below the view's top it starts.
  anchor() {
    if (this.atBottom) return null;
    const top = this.scroller.scrollTop;
    for (let i = this.start; i < this.end; i++) {
      const node = this.nodes.get(this.items[i]?.key);
      if (node && node.offsetTop + node.offsetHeight > top) return { key: this.items[i].key, offset: node.offsetTop - top };
    }
    return null;
  }

  dropNodes() {
    for (const node of this.nodes.values()) node.remove();
    this.nodes.clear();
    this.rough.clear();
  }

  // Heights of the window's elements (one layout, reads only); the top of `key`'s element, if in it.
  measure(key = null) {
    for (const [each, node] of this.nodes) if (node.isConnected) this.heights.set(each, node.offsetHeight);
    const node = key === null ? undefined : this.nodes.get(key);
    return node && node.isConnected ? node.offsetTop : null;
  }

  estimate() {
    if (!this.heights.size) return DEFAULT_HEIGHT_PX;
    let sum = 0;
    for (const height of this.heights.values()) sum += height;
    return sum / this.heights.size;
  }

  update(anchor) {
    const list = this.scroller;
    this.measure();
    const gap = parseFloat(getComputedStyle(list).rowGap) || 0;
    const guess = this.estimate();
    const slots = this.items.map((item) => (this.heights.get(item.key) ?? guess) + gap);
    // Item i starts at base + sum(slots[0..i)): the top spacer's place plus its own gap.
    const base = this.top.offsetTop + gap;
    const total = slots.reduce((a, b) => a + b, 0);
    // Where the view will be: at the end, or where the anchor keeps it (the anchor may have moved,
    // with items added above it), or where it is.
    let viewTop = list.scrollTop;
    if (this.atBottom) viewTop = Math.max(0, base + total - list.clientHeight);
    else if (anchor) {
      const index = this.items.findIndex((item) => item.key === anchor.key);
      if (index >= 0) viewTop = base + slots.slice(0, index).reduce((a, b) => a + b, 0) - anchor.offset;
    }
    const [start, end] = this.range(slots, base, viewTop - OVERSCAN_PX, viewTop + list.clientHeight + OVERSCAN_PX);
    const [seenStart, seenEnd] = this.range(slots, base, viewTop, viewTop + list.clientHeight);
    // What is in view is always made; the margins around it as long as this frame's budget lasts
    // (elements already made cost nothing), and the rest in the frames after.
    const deadline = performance.now() + RENDER_BUDGET_MS;
    const affordable = (index) => this.nodes.has(this.items[index].key) || performance.now() < deadline;
    let first = seenStart;
    let last = seenEnd;
    for (let index = first; index < last; index++) this.made(index);
    for (let grew = true; grew;) {
      grew = false;
      if (last < end && affordable(last)) this.made(last++), grew = true;
      if (first > start && affordable(first - 1)) this.made(--first), grew = true;
    }
    this.place(first, last);
    const refined = this.refineWithin(seenStart, seenEnd, first, last, deadline);
    if (first > start || last < end || !refined) this.schedule();
    // The spacers stand for items out of the window, whose heights this frame does not change: sized
    // before the one measure, which then gives the anchor's place as it will be.
    const sum = (from, to) => {
      let height = 0;
      for (let i = from; i < to; i++) height += (this.heights.get(this.items[i].key) ?? guess) + gap;
      return height;
    };
    this.top.style.height = `${sum(0, first)}px`;
    this.bottom.style.height = `${Math.max(0, sum(last, this.items.length) - gap)}px`;
    const anchorTop = this.measure(anchor && !this.atBottom ? anchor.key : null);
    this.restore(anchor, anchorTop);
  }

  // Refines the window's rough elements, those in view [seenStart, seenEnd) first and then outwards
  // through [first, last), while the budget lasts (one in view whatever it costs, so what is seen is
  // never left rough). True when none is left.
  refineWithin(seenStart, seenEnd, first, last, deadline) {
    if (!this.refine || !this.rough.size) return true;
    const order = [];
    for (let i = seenStart; i < seenEnd; i++) order.push(i);
    for (let up = seenStart - 1, down = seenEnd; up >= first || down < last; up--, down++) {
      if (up >= first) order.push(up);
      if (down < last) order.push(down);
    }
    let worked = false;
    for (const index of order) {
      const key = this.items[index].key;
      if (!this.rough.has(key)) continue;
      if (performance.now() >= deadline && (worked || index < seenStart || index >= seenEnd)) break;
      this.rough.delete(key);
      if (this.refine(this.items[index], this.nodes.get(key))) worked = true;
    }
    return this.rough.size === 0;
  }

  // Items [start, end) that lie (even partly) between `low` and `high`, item i starting at
  // base + sum(slots[0..i)).
  range(slots, base, low, high) {
    let start = 0;
    let position = base;
    while (start < slots.length - 1 && position + slots[start] < low) position += slots[start++];
    let end = start;
    while (end < slots.length && position <= high) position += slots[end++];
    return [start, end];
  }

  // Makes item `index`'s element unless it has one.
  made(index) {
    const item = this.items[index];
    if (this.nodes.has(item.key)) return;
    this.nodes.set(item.key, this.render(item));
    if (this.refine) this.rough.add(item.key);
  }

  // Puts the elements of items [start, end) between the spacers, in order (made by `made`), and takes
  // out the others.
  place(start, end) {
    const list = this.scroller;
    if (this.head && this.head.parentNode !== list) list.prepend(this.head);
    if (this.top.parentNode !== list) list.insertBefore(this.top, this.head ? this.head.nextSibling : list.firstChild);
    if (this.bottom.parentNode !== list) list.append(this.bottom);
    const wanted = new Map();
    for (let i = start; i < end; i++) wanted.set(this.items[i].key, this.items[i]);
    const active = document.activeElement;
    let lostFocus = false;
    for (const [key, node] of this.nodes) {
      if (wanted.has(key)) continue;
      if (node.contains(active)) lostFocus = true;
      node.remove();
      this.nodes.delete(key);
      this.rough.delete(key);
    }
    let cursor = this.top;
    for (const key of wanted.keys()) {
      const node = this.nodes.get(key);
      if (cursor.nextSibling !== node) list.insertBefore(node, cursor.nextSibling);
      cursor = node;
    }
    this.start = start;
    this.end = end;
    if (lostFocus && this.focusFallback) this.focusFallback().focus({ preventScroll: true });
  }

  // Scrolls so that the anchor is where it was (`anchorTop`: its element's top now), or to the end.
  restore(anchor, anchorTop) {
    const list = this.scroller;
    let target = null;
    if (this.atBottom) target = list.scrollHeight - list.clientHeight;
    else if (anchor && anchorTop !== null) target = anchorTop - anchor.offset;
    if (target === null || Math.abs(list.scrollTop - target) < 1) return;
    list.scrollTop = target;
    this.scrolledTo = list.scrollTop;
  }
}

function spacer() {
  const element = document.createElement("li");
  element.className = "spacer";
  element.setAttribute("aria-hidden", "true");
  return element;
}
