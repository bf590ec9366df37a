// A real OpenID Connect provider for the sign-in tests: panva's oidc-provider (pinned in package.json and
// package-lock.json; `make setup` runs `npm ci` here), configured for one confidential client, chatmesh's
// Envoy. Its login form accepts any user name (the library's development interactions): the name becomes
// the token's `sub`. Access tokens are JWTs for the chatmesh audience, signed with the key the test gives.
//
//   node server.mjs CONFIG.json    (port, issuer, client, redirect URIs, TTLs, signing JWKS)
//
// Prints one JSON line per event the tests watch (a code exchanged, a token refreshed, a sign-out).
import { readFileSync } from "node:fs";
import Provider from "oidc-provider";

const config = JSON.parse(readFileSync(process.argv[2], "utf8"));
const emit = (event, fields = {}) => console.log(JSON.stringify({ event, ...fields }));

const provider = new Provider(config.issuer, {
  clients: [{
    client_id: config.client_id,
    client_secret: config.client_secret,
    redirect_uris: [config.redirect_uri],
    post_logout_redirect_uris: [config.post_logout_redirect_uri],
    grant_types: ["authorization_code", "refresh_token"],
    response_types: ["code"],
    token_endpoint_auth_method: "client_secret_basic",
  }],
  jwks: config.jwks,
  cookies: { keys: [config.cookie_key] },
  // PKCE for every client, confidential ones too: a code without its verifier is refused.
  pkce: { required: () => true },
  ttl: {
    AccessToken: config.access_token_ttl_s,
    AuthorizationCode: 60,
    IdToken: config.access_token_ttl_s,
    RefreshToken: 3600,
    Grant: 3600,
    Session: 3600,
    Interaction: 600,
  },
  features: {
    devInteractions: { enabled: true },
    rpInitiatedLogout: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => config.resource,
      useGrantedResource: () => true,
      getResourceServerInfo: () => ({
        scope: "chat",
        audience: config.audience,
        accessTokenTTL: config.access_token_ttl_s,
        accessTokenFormat: "jwt",
        jwt: { sign: { alg: "RS256" } },
      }),
    },
  },
  scopes: ["openid", "profile", "offline_access", "chat"],
  // chatmesh's own client: no consent screen, everything it asks for is granted.
  loadExistingGrant: async (ctx) => {
    const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope("openid profile offline_access");
    grant.addResourceScope(config.resource, "chat");
    await grant.save();
    return grant;
  },
  issueRefreshToken: async (_ctx, client) => client.grantTypeAllowed("refresh_token"),
  extraTokenClaims: async () => ({ tier: config.tier }),
  findAccount: async (_ctx, sub) => ({ accountId: sub, claims: async () => ({ sub, name: sub }) }),
});
provider.proxy = false;

provider.on("grant.success", (ctx) => emit("grant", { grant_type: ctx.oidc.params.grant_type }));
provider.on("grant.error", (_ctx, error) => emit("grant_error", { error: error.message, detail: error.error_description }));
provider.on("authorization.error", (_ctx, error) => emit("authorization_error", { error: error.message, detail: error.error_description }));
provider.on("end_session.success", () => emit("end_session"));
provider.on("end_session.error", (_ctx, error) => emit("end_session_error", { error: error.message, detail: error.error_description, cause: String(error.cause) }));

provider.listen(config.port, "127.0.0.1", () => emit("listening", { issuer: config.issuer }));
