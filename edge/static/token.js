// The bearer token a page works with: `make run` prints URLs that carry it as #token=...; it is kept in
// localStorage under the page's own key and taken out of the address bar (and so out of the history).
export function takeTokenFromUrl(storageKey) {
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    localStorage.setItem(storageKey, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return localStorage.getItem(storageKey);
}
