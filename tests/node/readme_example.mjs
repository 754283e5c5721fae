import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, tool } from 'ai';
import { z } from 'zod';

// The gateway's URL and API key; the header adds the fleet's tools beside your own.
const toolfleet = createOpenAI({ baseURL: `${process.env.TOOLFLEET_URL}/v1`,
  apiKey: process.env.TOOLFLEET_API_KEY, headers: { 'X-Toolfleet-Tools': 'fleet' } });
const { text } = await generateText({
  model: toolfleet.chat('gpt-4.1-mini'),
  tools: { get_weather: tool({ description: 'The weather in a city',
    inputSchema: z.object({ city: z.string() }), execute: async ({ city }) => `sunny in ${city}` }) },
  stopWhen: stepCountIs(5),
  prompt: 'What is the weather in Lyon, and what do I owe? I am cust_001.',
});
console.log(text);
