// Real JavaScript clients against the gateway's /v1/chat/completions, each with one tool
// of its own (get_weather) and the fleet's tools asked for with the X-Toolfleet-Tools
// header. Usage: node clients.mjs BASE_URL API_KEY SCENARIO, where SCENARIO is
// ai-generate, ai-stream (the Vercel AI SDK's generateText and streamText) or
// openai-plain, openai-stream (the official openai client, looping by hand). Prints
// one JSON object: {text, finishReason, steps, ownCalls: [{id, input}]}.
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, streamText, tool } from 'ai';
import OpenAI from 'openai';
import { z } from 'zod';

const [BASE, KEY, SCENARIO] = process.argv.slice(2);
const HEADERS = { 'X-Toolfleet-Tools': 'fleet' };
const PROMPT = 'What is the weather in Lyon, and what do I owe? I am cust_001.';
const ownCalls = [];

async function aiSdk(stream) {
  const toolfleet = createOpenAI({ baseURL: `${BASE}/v1`, apiKey: KEY, headers: HEADERS });
  const args = {
    model: toolfleet.chat('any-model'),
    tools: {
      get_weather: tool({
        description: 'The weather in a city',
        inputSchema: z.object({ city: z.string() }),
        execute: async ({ city }, { toolCallId }) => {
          ownCalls.push({ id: toolCallId, input: { city } });
          return 'sunny';
        },
      }),
    },
    stopWhen: stepCountIs(5),
    maxRetries: 0,
    prompt: PROMPT,
  };
  if (!stream) {
    const result = await generateText(args);
    return { text: result.text, finishReason: result.finishReason, steps: result.steps.length };
  }
  let failure;
  const result = streamText({ ...args, onError: ({ error }) => { failure = error; } });
  let text = '';
  for await (const piece of result.textStream) text += piece;
  if (failure) throw failure;
  return { text, finishReason: await result.finishReason, steps: (await result.steps).length };
}

async function openai(stream) {
  const client = new OpenAI({ baseURL: `${BASE}/v1`, apiKey: KEY, defaultHeaders: HEADERS, maxRetries: 0 });
  const tools = [{
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'The weather in a city',
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
    },
  }];
  const messages = [{ role: 'user', content: PROMPT }];
  for (let steps = 1; steps <= 5; steps++) {
    const request = { model: 'any-model', messages, tools };
    const completion = stream
      ? await client.chat.completions.stream(request).finalChatCompletion()
      : await client.chat.completions.create(request);
    const { message, finish_reason: finishReason } = completion.choices[0];
    if (finishReason !== 'tool_calls') return { text: message.content, finishReason, steps };
    messages.push(message);
    // Only our own calls get a result: the gateway adds the fleet's.
    for (const call of message.tool_calls) {
      if (call.function.name !== 'get_weather') continue;
      ownCalls.push({ id: call.id, input: JSON.parse(call.function.arguments) });
      messages.push({ role: 'tool', tool_call_id: call.id, content: 'sunny' });
    }
  }
  throw new Error('no answer after 5 steps');
}

const run = {
  'ai-generate': () => aiSdk(false),
  'ai-stream': () => aiSdk(true),
  'openai-plain': () => openai(false),
  'openai-stream': () => openai(true),
}[SCENARIO];
if (!run) throw new Error(`unknown scenario ${SCENARIO}`);
console.log(JSON.stringify({ ...(await run()), ownCalls }));
