// How a page proves who uses it. Signed in through the identity provider (docs/deploy/sign-in.md) it
// holds no token at all: Envoy keeps the session in HttpOnly cookies that no script can read, refreshes
// it, and adds the bearer token to the page's calls itself. The dev flow (`make run` prints URLs that
// carry a token as #token=...) and tokens pasted in are kept in sessionStorage: this tab only, gone when it
// closes, and taken out of the address bar (and so out of the history).
export const SIGN_OUT_PATH = "/oauth2/signout";

export function takeTokenFromUrl(storageKey) {
  // Versions before sign-in kept the token in localStorage, where it outlived every tab: not any more.
  localStorage.removeItem(storageKey);
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    sessionStorage.setItem(storageKey, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(storageKey);
}

export function keepToken(storageKey, token) {
  sessionStorage.setItem(storageKey, token);
}

// The headers a call carries: none with a session (Envoy adds the bearer), else the token's.
export function authHeaders(token) {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

// A pasted token is forgotten; a session is ended at Envoy, which clears its cookies and ends the
// provider's session too, so the next visit asks to sign in again.
export function signOut(storageKey, token) {
  sessionStorage.removeItem(storageKey);
  if (token) location.reload();
  else location.assign(SIGN_OUT_PATH);
}
