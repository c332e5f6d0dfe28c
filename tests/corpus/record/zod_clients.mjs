// zod's JSON Schema, and the openai npm SDK's zod helpers against the recorder.
//
// Run by record.py from the npm prefix it installed (ESM resolves imports from the script's
// folder, so record.py copies this file there): `node zod_clients.mjs BASE_URL`. It sends its
// requests to the recorder and prints one JSON document on stdout: the versions and the
// schemas that zod itself writes (z.toJSONSchema, zod-to-json-schema).
import { readFileSync } from "node:fs";
import OpenAI from "openai";
import { zodFunction, zodResponseFormat, zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";
import * as z3 from "zod/v3";
import { zodToJsonSchema } from "zod-to-json-schema";

const base = process.argv[2];
const version = (name) => JSON.parse(readFileSync(`node_modules/${name}/package.json`, "utf8")).version;

// Representative schemas, written as zod users write them (OpenAI's strict mode wants
// every field required: optional ones are .nullable()).
const Forecast = z.object({
  city: z.enum(["Paris", "Rome", "Oslo"]),
  days: z.number().int().min(1).max(7),
  unit: z.literal("celsius").nullable(),
  at: z.string().datetime().nullable(),
});
const Contact = z.object({
  name: z.string().min(1).max(40),
  email: z.string().email(),
  site: z.string().url().nullable(),
  phone: z.string().regex(/^\+?[0-9 ]{6,15}$/),
  tags: z.array(z.string()).min(1).max(3),
  id: z.string().uuid(),
});
const Shape = z.object({
  shape: z.discriminatedUnion("kind", [
    z.object({ kind: z.literal("circle"), radius: z.number().positive() }),
    z.object({ kind: z.literal("square"), side: z.number().min(0) }),
  ]),
});
const Category = z.object({
  name: z.string(),
  get children() {
    return z.array(Category);
  },
});
const Lookup = z.object({ query: z.string().describe("what to look up"), limit: z.number().int().min(1).max(10).nullable() });

const schemas = {};
for (const [name, s] of Object.entries({ Forecast, Contact, Shape, Category, Lookup })) {
  schemas[`toJSONSchema/${name}`] = z.toJSONSchema(s);
}
// Open (non-strict) shapes that only z.toJSONSchema sees: optional fields, records, tuples.
schemas["toJSONSchema/Open"] = z.toJSONSchema(
  z.object({
    title: z.string().optional(),
    counts: z.record(z.string(), z.number().int()),
    point: z.tuple([z.number(), z.number()]),
    when: z.iso.date(),
    mode: z.union([z.literal("fast"), z.literal("slow")]).default("fast"),
  }),
);
// zod-to-json-schema (the zod 3 converter many libraries still call), on zod 3 schemas.
const Forecast3 = z3.object({ city: z3.enum(["Paris", "Rome", "Oslo"]), days: z3.number().int().min(1).max(7), at: z3.string().datetime().optional() });
const Contact3 = z3.object({ email: z3.string().email(), site: z3.string().url().optional(), phone: z3.string().regex(/^\+?[0-9 ]{6,15}$/), tags: z3.array(z3.string()).min(1).max(3) });
schemas["zod-to-json-schema/Forecast"] = zodToJsonSchema(Forecast3);
schemas["zod-to-json-schema/Contact"] = zodToJsonSchema(Contact3);
schemas["zod-to-json-schema/openAi/Forecast"] = zodToJsonSchema(Forecast3, { target: "openAi" });

const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "dummy", maxRetries: 0 });
const user = [{ role: "user", content: "Weather in Paris for 3 days?" }];
const failures = {};
const scenario = async (name, run) => {
  await fetch(`${base}/__scenario`, { method: "POST", body: name });
  try {
    await run();
  } catch (e) {
    failures[name] = String(e).slice(0, 300);  // the recorder's reply failed the client's check
  }
};
await scenario("zodResponseFormat", () =>
  client.chat.completions.parse({ model: "gpt-test", messages: user, response_format: zodResponseFormat(Forecast, "forecast") }));
await scenario("zodResponseFormat-contact", () =>
  client.chat.completions.parse({ model: "gpt-test", messages: user, response_format: zodResponseFormat(Contact, "contact") }));
await scenario("zodFunction-required", () =>
  client.chat.completions.parse({
    model: "gpt-test", messages: user, tool_choice: "required",
    tools: [zodFunction({ name: "lookup", parameters: Lookup }), zodFunction({ name: "draw", parameters: Shape })],
  }));
await scenario("runTools-zodFunction", () =>
  client.chat.completions.runTools({
    model: "gpt-test", messages: user,
    tools: [zodFunction({ name: "lookup", parameters: Lookup, function: (args) => ({ found: args.query }) })],
  }).finalContent());
await scenario("zodTextFormat-responses", () =>
  client.responses.parse({ model: "gpt-test", input: "Weather in Paris?", text: { format: zodTextFormat(Forecast, "forecast") } }));
await scenario("zodTextFormat-recursive-responses", () =>
  client.responses.parse({ model: "gpt-test", input: "A category tree", text: { format: zodTextFormat(Category, "category") } }));

console.log(JSON.stringify({
  versions: { openai: version("openai"), zod: version("zod"), "zod-to-json-schema": version("zod-to-json-schema"), node: process.version },
  schemas,
  failures,
}));
